"""Sweep the MLA decode kernel's schedules (tile keys, warps, stages, lazy-rescale slack, latent column groups) and
split targets on a GPU.

    python scripts/tune_mla_decode.py --out $OUT            # the target cases of bench_mla.py, a few minutes
    python scripts/tune_mla_decode.py --smoke               # three candidates on tiny shapes (CPU interpreter)
    python scripts/tune_mla_decode.py --tma --out $OUT      # schedules whose whole tiles TMA copies (at 64 rows
                                                            # also the Gluon kernel's, Schedule.wgmma)
    python scripts/tune_mla_decode.py --cases 128,16,1,8192,fp8 --schedules 64,8,5,0,1,tma
                                                            # only these candidates (and the committed one)

For each case it times every candidate `Schedule` of the case's tile class (the kernel's SCHEDULES key: KV element
bytes and tile rows), and the committed one, each splitting for 2 programs an SM; then the best three and the
committed one splitting for 1, 4 and 8 (the Schedule's min_waves). Candidates are compiled first by a pool of
worker processes (Triton's on-disk cache is shared), so the timing pass does not wait on the compiler. One JSON
object per timing goes to <out>/tune_mla_decode.jsonl; the best per case is printed last, as the lines to put into
kimi_helix/kernels/mla/decode_schedule.py.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Sweeps are history, not current results: docs/benchmarks.md reads benchmarks/results/*.jsonl only.
HISTORY = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "history"
from bench_common import JsonlWriter, precompile, run_metadata  # noqa: E402
from bench_mla import KV_DTYPES, KV_LORA, ROPE, Cache  # noqa: E402

from kimi_helix.kernels.mla import decode  # noqa: E402

CASES = [  # (b, h, s_q, s_k, kv): the targets of bench_mla.py and the fp8 cases at both ends
    (128, 16, 1, 8192, "bf16"),
    (128, 32, 1, 8192, "bf16"),
    (128, 128, 1, 8192, "bf16"),
    (128, 16, 4, 8192, "bf16"),
    (128, 32, 4, 8192, "bf16"),
    (128, 16, 1, 8192, "fp8"),
    (128, 128, 1, 8192, "fp8"),
    (1, 16, 1, 32768, "bf16"),
]
SMOKE_CASES = [(2, 16, 1, 40, "fp16")]


DEFAULTS = dict(decode.SCHEDULES)  # the committed schedules, before the sweep overrides them


def candidates(rows: int, smoke: bool, tma: bool) -> list[decode.Schedule]:
    if smoke:
        return [decode.Schedule(32, 4, 1, 0.0, tma=tma), decode.Schedule(32, 4, 1, 8.0, tma=tma, d_split=2),
                decode.Schedule(32, 4, 1, 0.0, tma=tma, d_split=4)]  # fmt: skip
    # 48 candidates a case. Gathered tiles at 16 and 32 rows leave out 32 keys and one stage (slower, see
    # docs/benchmark-history.md) and four stages, to make room for the latent column groups; TMA tiles must fit
    # inside bench_mla.py's 64-key pages.
    block_ns = (32, 64) if rows == 64 or tma else (64, 128)
    grid = itertools.product(block_ns, (4, 8), (2, 3), (0.0, 8.0), decode.D_SPLITS)
    cands = [decode.Schedule(n, w, st, slack, tma=tma, d_split=d) for n, w, st, slack, d in grid]
    if rows == 64 and tma:
        # The Gluon kernel's tiles and buffers (its warps are fixed).
        cands += [decode.Schedule(n, 8, st, 0.0, tma=True, wgmma=True) for n, st in ((64, 2), (32, 3), (32, 4))]
    return cands


def sweep(case, smoke: bool, tma: bool = False, given: list | None = None) -> list[decode.Schedule]:
    """The candidates of the case's tile class (`given`, else the grid of `candidates`: TMA tiles or gathered ones;
    with the class's committed shortest split) and the committed schedule, each once."""
    key = tile_key(case)
    tiles = DEFAULTS[key].min_split_tiles
    cands = [c._replace(min_split_tiles=tiles) for c in (given or candidates(key[1], smoke, tma))]
    return list(dict.fromkeys([*cands, _committed(key)]))


def parse_schedule(text: str) -> decode.Schedule:
    """ "block_n,warps,stages,slack,d_split[,tma][,wgmma]" (e.g. "64,8,5,0,1,tma") as a Schedule."""
    parts = text.split(",")
    flags = set(parts[5:])
    try:
        n, w, st, d = (int(parts[i]) for i in (0, 1, 2, 4))
        slack = float(parts[3])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not block_n,warps,stages,slack,d_split[,tma][,wgmma]") from None
    if not flags <= {"tma", "wgmma"} or d not in decode.D_SPLITS:
        raise argparse.ArgumentTypeError(f"{text!r}: flags must be tma or wgmma, d_split one of {decode.D_SPLITS}")
    return decode.Schedule(n, w, st, slack, tma="tma" in flags, d_split=d, wgmma="wgmma" in flags)


def _committed(key) -> decode.Schedule:
    """The committed schedule of a tile class with the default split target (the sweep sets its own)."""
    return DEFAULTS[key]._replace(min_waves=decode.MIN_WAVES)


def tile_key(case) -> tuple[int, int]:
    b, h, s_q, _, kv = case
    cfg, _ = decode.choose_tiles(h, b * s_q, b, torch.bfloat16, 1 if kv == "fp8" else 2, KV_LORA)
    return (1 if kv == "fp8" else 2, cfg["BLOCK_Q"] * cfg["BLOCK_H"])


def make_call(cache: Cache, b: int, h: int, s_q: int, device, dtype, splits: int | None = None):
    T = b * s_q
    q = torch.randn(T, h, KV_LORA + ROPE, device=device, dtype=dtype)
    cu = torch.arange(0, T + 1, s_q, dtype=torch.int32, device=device)
    tables = itertools.cycle(cache.tables)
    return lambda: decode.mla_decode_triton(q, cache.kv, next(tables), cache.lens, cu, 192**-0.5, KV_LORA, None,
                                            cache.scale, splits)  # fmt: skip


def parse_case(text: str) -> tuple:
    """ "b,h,s_q,s_k,kv" (e.g. "128,16,1,8192,bf16") as a case tuple; argparse reports a malformed one."""
    *dims, kv = text.split(",")
    if len(dims) != 4 or not all(d.isdigit() and int(d) > 0 for d in dims) or kv not in KV_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not b,h,s_q,s_k,kv with four positive integers and kv in {sorted(KV_DTYPES)}"
        )
    return (*map(int, dims), kv)


def _compile(job) -> None:
    """Worker: run one (case, schedule) once so that Triton compiles and caches it."""
    case, sched, smoke = job
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if smoke else torch.bfloat16
    b, h, s_q, s_k, kv = case
    decode.SCHEDULES[tile_key(case)] = sched
    # the case's own shapes: Triton specialises on strides (a block table of 160 pages is a multiple of 16)
    cache = Cache(b, s_k, kv, device, dtype)
    for splits in (1, 3):  # both the single-pass and the split-KV variant of the kernel
        make_call(cache, b, h, s_q, device, dtype, splits)()


def time_ms(fn, device, smoke: bool) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    from bench_common import bench_ms

    return bench_ms(fn, device, cpu_reps=1)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument(
        "--out", default=HISTORY, help="directory for tune_mla_decode.jsonl (default: benchmarks/results/history)"
    )
    ap.add_argument("--cases", nargs="+", type=parse_case, help="only these cases, each as b,h,s_q,s_k,kv")
    ap.add_argument("--tma", action="store_true", help="sweep schedules whose whole tiles are copied by TMA")
    ap.add_argument("--schedules", nargs="+", type=parse_schedule,
                    help="only these candidates: block_n,warps,stages,slack,d_split[,tma][,wgmma] each")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compiling processes")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if args.smoke else torch.bfloat16
    cases = SMOKE_CASES if args.smoke else CASES
    if args.cases:
        cases = args.cases
    jobs = [(c, s, args.smoke) for c in cases for s in sweep(c, args.smoke, args.tma, args.schedules)]
    errors = dict(zip(((c, s) for c, s, _ in jobs), precompile(_compile, jobs, args.jobs, device)))

    meta = run_metadata()
    best = {}
    path = Path(args.out) / "tune_mla_decode.jsonl"
    with JsonlWriter(path, echo=sys.stderr) as results:
        for case in cases:
            b, h, s_q, s_k, kv = case
            key = tile_key(case)
            cache = Cache(b, s_k, kv, device, dtype)
            timed = []
            first = [(s, 2) for s in sweep(case, args.smoke, args.tma, args.schedules)]
            for sched, waves in first + [(None, w) for w in (1, 4, 8)]:
                if sched is None:  # second pass: the best three schedules at other split targets
                    tops = [s for _, s, _ in sorted(t for t in timed if t[2] == 2)[:3]]
                    # the committed schedule too, so that a sweep never loses to a setting it did not time
                    runs = [(s, waves) for s in dict.fromkeys([*tops, _committed(key)])]
                else:
                    runs = [(sched, waves)]
                for s, w in runs:
                    rec = dict(meta, b=b, h=h, s_q=s_q, s_k=s_k, kv_dtype=kv, key=list(key),
                               schedule=list(s._replace(min_waves=w)), min_waves=w, ms=None,
                               error=errors.get((case, s)))  # fmt: skip
                    if rec["error"] is None:
                        decode.SCHEDULES[key] = s._replace(min_waves=w)
                        try:
                            call = make_call(cache, b, h, s_q, device, dtype)
                            rec["ms"] = round(time_ms(call, device, args.smoke), 4)
                            timed.append((rec["ms"], s, w))
                        except Exception as err:
                            rec["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                        finally:  # the module leaves the sweep as it entered it
                            decode.SCHEDULES[key] = DEFAULTS[key]
                    results.write(rec)
            del cache
            if timed:
                best[case] = min(timed)
    print("\nbest per case (ms, schedule):")
    for case, (ms, s, w) in best.items():
        print(f"  {case}: {ms:.4f} ms  {s._replace(min_waves=w)}")
    return results.records


if __name__ == "__main__":
    main()
