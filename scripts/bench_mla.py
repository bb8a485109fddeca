"""Benchmark the MLA decode/verify kernel (absorbed MLA over the paged latent cache) against the GPU's roofline.

    python scripts/bench_mla.py            # the full grid (H200: a few minutes)
    python scripts/bench_mla.py --quick    # a subset plus the target cases, for limited GPU time
    python scripts/bench_mla.py --smoke    # tiny shapes; runs on the CPU under the Triton interpreter
    python scripts/bench_mla.py --b 1 8 --h 32 --s-q 1 --s-k 4096 --kv bf16 fp8 --backends triton --jobs 8
                                           # a grid of its own, compiled first by 8 processes

Each case is timed with triton.testing.do_bench (median) while rotating over several block tables into one large
cache, so the latents come from HBM rather than L2. TB/s counts the latents read once plus q, out and lse; TFLOP/s
counts 2 * s_q * sum(s_k) * H * (2 * kv_lora_rank + rope_dim). The same run measures the roofline (a >= 1 GiB
device-to-device copy, read + write, and a bf16 8192^3 matmul). The Triton kernel is also timed by CUDA-graph
replays (graph_ms: GPU time alone; call by call, small cases are bound by the host). One JSON object per case goes to
<out>/mla_decode.jsonl; a failing case is recorded with its error and the run goes on. A markdown table ends it.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import JsonlWriter, bench_ms, copy_tbps, matmul_tflops, precompile, run_metadata  # noqa: E402

from kimi_helix.kernels.mla import decode_schedule  # noqa: E402
from kimi_helix.kernels.mla.decode import mla_decode_triton  # noqa: E402
from kimi_helix.kernels.mla.naive import mla_decode_ref  # noqa: E402

KV_LORA, ROPE, PAGE_SIZE = 512, 64, 64
FP8 = torch.float8_e4m3fn
KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}
ROTATE_BYTES = 1 << 30  # latents touched across the rotated block tables: far beyond the 60 MB L2

GRID = dict(b=[1, 32, 128], h=[16, 32, 64, 96, 128], s_q=[1, 2, 4], s_k=[4096, 8192, 32768], kv=["bf16", "fp8"])
QUICK = dict(b=[1, 128], h=[16, 128], s_q=[1, 4], s_k=[8192], kv=["bf16", "fp8"])
# The targets: memory-bound H=16, compute-bound H=128, and verify (s_q=4) against decode for H <= 32.
TARGETS = [
    (128, 16, 1, 8192, "bf16"),
    (128, 128, 1, 8192, "bf16"),
    (128, 32, 1, 8192, "bf16"),
    (128, 32, 4, 8192, "bf16"),
]
# The torch reference loops over sequences in Python: it runs on the grid's cases of up to REF_MAX_B sequences.
REF_MAX_B = 32
SMOKE = dict(b=[2], h=[1, 16], s_q=[1, 2], s_k=[40], kv=["fp16", "fp8"])
# The fp8 schedules a run may time (--fp8-schedules), by name.
FP8_SCHEDULES = {"committed": dict(decode_schedule.SCHEDULES), "triton": decode_schedule.TRITON_FP8_SCHEDULES}


class Cache:
    """A paged latent cache large enough for several disjoint block tables of one (b, s_k, kv) shape."""

    def __init__(self, b, s_k, kv, device, q_dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        # Lengths spread +-25% around the mean, as a continuous batch has.
        lens = torch.randint(max(1, s_k * 3 // 4), s_k * 5 // 4 + 1, (b,), generator=gen)
        pages_per_seq = (lens + PAGE_SIZE - 1) // PAGE_SIZE
        need = int(pages_per_seq.sum())
        elem = 1 if kv == "fp8" else 2
        page_bytes = PAGE_SIZE * (KV_LORA + ROPE) * elem
        self.rotations = max(1, min(16, ROTATE_BYTES // (need * page_bytes)))
        num_pages = need * self.rotations
        perm = torch.randperm(num_pages, generator=gen).int()
        max_pages = int(pages_per_seq.max())
        self.tables = []
        for r in range(self.rotations):
            table = torch.zeros(b, max_pages, dtype=torch.int32)
            ids = perm[r * need : (r + 1) * need].split(pages_per_seq.tolist())
            for i, p in enumerate(ids):
                table[i, : len(p)] = p
            self.tables.append(table.to(device))
        self.lens = lens.int().to(device)
        self.total_keys = int(lens.sum())
        data = torch.randn(num_pages, PAGE_SIZE, KV_LORA + ROPE, device=device, dtype=q_dtype)
        if kv == "fp8":
            self.scale = torch.rand(num_pages, PAGE_SIZE, device=device) * 0.02 + 0.01
            self.kv = (data.float() / self.scale[..., None]).clamp(-448, 448).to(FP8)
        else:
            self.scale, self.kv = None, data.to(KV_DTYPES[kv])
        self.kv_bytes = self.total_keys * ((KV_LORA + ROPE) * elem + (4 if kv == "fp8" else 0))


def run_case(cache, b, h, s_q, backend, device, q_dtype, splits=None):
    """Time one case (the Triton kernel with `splits` KV splits, None: its own choice); returns (ms, tbps, tflops,
    graph_ms): graph_ms (the Triton kernel on the GPU only, else None) is the GPU time of CUDA-graph replays,
    without the host's launch cost that bounds small cases timed call by call."""
    gen = torch.Generator().manual_seed(h * 7 + s_q)
    T = b * s_q
    q = torch.randn(T, h, KV_LORA + ROPE, generator=gen).to(device=device, dtype=q_dtype)
    cu = torch.arange(0, T + 1, s_q, dtype=torch.int32, device=device)
    tables = itertools.cycle(cache.tables)

    def call():
        args = (q, cache.kv, next(tables), cache.lens, cu, 192**-0.5, KV_LORA, None, cache.scale)
        return mla_decode_triton(*args, splits) if backend == "triton" else mla_decode_ref(*args)

    ms = bench_ms(call, device)
    graph_ms = bench_ms(call, device, graph=True) if backend == "triton" and device.type == "cuda" else None
    io_bytes = cache.kv_bytes + q.numel() * q.element_size() + T * h * (KV_LORA * q.element_size() + 4)
    flops = 2 * s_q * cache.total_keys * h * (2 * KV_LORA + ROPE)
    return ms, io_bytes / ms / 1e9, flops / ms / 1e9, graph_ms


def _compile(case) -> None:
    """Worker: one call of the Triton kernel at the case's shapes, so that Triton compiles and caches its variant."""
    b, h, s_q, s_k, kv = case
    device = torch.device("cuda")
    cache = Cache(b, s_k, kv, device, torch.bfloat16)
    q = torch.zeros(b * s_q, h, KV_LORA + ROPE, device=device, dtype=torch.bfloat16)
    cu = torch.arange(0, b * s_q + 1, s_q, dtype=torch.int32, device=device)
    mla_decode_triton(q, cache.kv, cache.tables[0], cache.lens, cu, 192**-0.5, KV_LORA, None, cache.scale)


def main(argv=None) -> list[dict]:
    """Run the benchmark; returns the records written."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a subset plus the target cases")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter): checks it runs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"))
    ap.add_argument("--backends", nargs="+", choices=("triton", "torch"), default=["triton", "torch"],
                    help="what to time (the torch reference only on cases of up to REF_MAX_B sequences)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=1, help="processes that compile the Triton cases before timing")
    ap.add_argument("--splits", nargs="+", type=int, default=[], help="also time the Triton kernel at these KV splits")
    ap.add_argument("--fp8-schedules", nargs="+", choices=FP8_SCHEDULES, default=["committed"],
                    help="fp8 cases under these schedules: the committed ones (the Gluon kernel where they say so) "
                         "and/or TRITON_FP8_SCHEDULES (the Triton kernel alone)")  # fmt: skip
    for key in GRID:
        ap.add_argument(f"--{key.replace('_', '-')}", nargs="+", type=str if key == "kv" else int, help="override")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q_dtype = torch.float16 if args.smoke else torch.bfloat16  # the interpreter computes bf16 wrongly
    grid = dict(SMOKE if args.smoke else QUICK if args.quick else GRID)
    grid.update({k: getattr(args, k) for k in GRID if getattr(args, k) is not None})
    cases = list(itertools.product(grid["b"], grid["h"], grid["s_q"], grid["s_k"], grid["kv"]))
    if args.quick:
        cases += [c for c in TARGETS if c not in cases]
    # (case, backend, forced KV splits or None, fp8 schedules); 16-bit cases run once, under "committed"
    fp8_modes = lambda c: args.fp8_schedules if c[4] == "fp8" else ["committed"]  # noqa: E731
    triton_runs = [(c, "triton", n, m) for c in cases for n in [None, *args.splits] for m in fp8_modes(c)]
    runs = triton_runs if "triton" in args.backends else []
    if not args.quick and "torch" in args.backends:
        ref_cases = cases[:2] if args.smoke else [c for c in cases if c[0] <= REF_MAX_B]
        runs += [(c, "torch", None, "committed") for c in ref_cases]

    errors = precompile(_compile, sorted({c for c, backend, n, _ in runs if backend == "triton" and n is None}),
                        args.jobs, device)  # fmt: skip
    if any(errors):
        print("compile errors:", [e for e in errors if e], file=sys.stderr)
    copy = copy_tbps(device, gib=1 / 1024 if args.smoke else 2)
    matmul = matmul_tflops(device, n=128 if args.smoke else 8192)
    base = dict(run_metadata(), copy_tbps=round(copy, 3), matmul_tflops=round(matmul, 1))
    cache, cache_key = None, None
    # Appended case by case: a killed run keeps what it measured.
    with JsonlWriter(Path(args.out) / "mla_decode.jsonl", echo=sys.stderr) as results:
        # Grouped by cache shape so each large cache is built once; small batches first.
        for (b, h, s_q, s_k, kv), backend, splits, fp8_mode in sorted(
            runs, key=lambda r: (r[0][0], r[0][3], r[0][4], r[1], r[2] or 0, r[3])
        ):
            rec = dict(base, b=b, h=h, s_q=s_q, s_k=s_k, kv_dtype=kv, backend=backend, splits=splits, ms=None,
                       tbps=None, tflops=None, graph_ms=None, fp8_schedules=fp8_mode)  # fmt: skip
            decode_schedule.SCHEDULES.update(FP8_SCHEDULES[fp8_mode])
            try:
                if cache_key != (b, s_k, kv):
                    cache, cache_key = None, None  # free the previous one first
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    cache, cache_key = Cache(b, s_k, kv, device, q_dtype), (b, s_k, kv)
                ms, tbps, tflops, graph_ms = run_case(cache, b, h, s_q, backend, device, q_dtype, splits)
                rec.update(ms=round(ms, 4), tbps=round(tbps, 3), tflops=round(tflops, 1), error=None)
                rec["graph_ms"] = None if graph_ms is None else round(graph_ms, 4)
            except Exception as err:  # a failing case is recorded, the rest still run
                rec["error"] = f"{type(err).__name__}: {err}"[:500]
            results.write(rec)

    records = results.records
    print(f"\n{base['gpu']}: copy {copy:.2f} TB/s, bf16 matmul {matmul:.0f} TFLOP/s\n")
    decode_schedule.SCHEDULES.update(FP8_SCHEDULES["committed"])
    print("| backend | splits | b | H | s_q | s_k | kv | ms | TB/s | TFLOP/s | graph ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        kv = r["kv_dtype"] + (f" ({r['fp8_schedules']})" if r["kv_dtype"] == "fp8" else "")
        shape = f"{r['b']} | {r['h']} | {r['s_q']} | {r['s_k']} | {kv}"
        head = f"| {r['backend']} | {r['splits'] or 'auto'} | {shape} |"
        if r["error"]:
            print(f"{head} error: {r['error'][:60]} | | | |")
        else:
            print(f"{head} {r['ms']:.3f} | {r['tbps']:.2f} | {r['tflops']:.1f} | {r['graph_ms'] or '-'} |")
    return records


if __name__ == "__main__":
    main()
