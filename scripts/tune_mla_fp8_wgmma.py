"""Time variants of the fp8 Gluon MLA decode kernel (`decode_fp8_wgmma`, 16 tile rows on sm_90) in one bounded
GPU call: its dequant side (`decode.Fp8WgmmaParams`: raw tiles in flight, dequant warpgroups, their registers) and
the split target (the (1, 16) Schedule's min_waves), each checked against the torch reference.

    python scripts/tune_mla_fp8_wgmma.py --out $OUT                 # the variants below, b=128 and b=1, H=16, 8k
    python scripts/tune_mla_fp8_wgmma.py --variants 2,1,232,4 2,2,128,4 --out $OUT
    python scripts/tune_mla_fp8_wgmma.py --print-sm90               # compile each variant for sm_90 here, no GPU:
                                                                    # registers, spills, shared memory

A variant is lookahead,warpgroups,regs,min_waves[,l2_prefetch] ("triton,min_waves" times the Triton fp8 kernel
instead). Phase 1 runs every variant once in its own process (--jobs at a time, each killed after --variant-timeout
seconds, so a variant that hangs or fails is recorded, not fatal): Triton compiles and caches it, and its output on
the first block table is compared with `naive.mla_decode_ref` (max |out - ref| / max |ref|, lse likewise). Phase 2
times the variants that passed, one process, the cases in turn, stopped at --budget seconds from the start. One JSON
object a variant and case goes to <out>/tune_mla_fp8_wgmma.jsonl (phase "check", then "time"); the table is printed
last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kimi_helix, in the workers too

CASES = [(128, 16, 1, 8192), (1, 16, 1, 8192)]  # (b, h, s_q, mean s_k), an fp8 cache, bf16 q
# lookahead, dequant warpgroups, their registers, min_waves, L2 prefetch distance; the committed one first. Each
# compiles for sm_90 without spills (--print-sm90); lookahead 3 spills at both warpgroup counts, 2 warpgroups above
# 128 registers spill the MMA warpgroup (it gets 512 - 2 x regs).
VARIANTS = [
    "2,1,232,4,2",
    "2,1,232,4",
    "2,1,232,4,1",
    "2,1,232,4,4",
    "2,1,232,2,2",
    "2,1,232,8,2",
    "2,2,128,4,2",
    "1,1,232,4",
    "triton,4",
]
TOL = 2e-2


def parse_variant(text: str) -> tuple:
    parts = text.split(",")
    if parts[0] == "triton" and len(parts) == 2 and parts[1].isdigit():
        return ("triton", int(parts[1]))
    if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not lookahead,warpgroups,regs,min_waves[,l2_prefetch] or triton,min_waves"
        )
    return tuple(int(p) for p in parts)


def _apply(variant) -> None:
    """Set the module's knobs to the variant (this process only)."""
    from kimi_helix.kernels.mla import decode

    key = (1, 16)
    if variant[0] == "triton":
        decode.SCHEDULES[key] = decode.TRITON_FP8_SCHEDULES[key]._replace(min_waves=variant[1])
        return
    la, wgs, regs, waves, *prefetch = variant
    decode.FP8_WGMMA = decode.Fp8WgmmaParams(la, wgs, regs, *prefetch)
    decode.SCHEDULES[key] = decode.SCHEDULES[key]._replace(wgmma=True, min_waves=waves)


def _case_setup(case):
    import torch
    from bench_mla import Cache

    b, h, s_q, s_k = case
    device = torch.device("cuda")
    cache = Cache(b, s_k, "fp8", device, torch.bfloat16)
    gen = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(b * s_q, h, 576, generator=gen).to(device, torch.bfloat16)
    cu = torch.arange(0, b * s_q + 1, s_q, dtype=torch.int32, device=device)
    return cache, q, cu


def worker_check(variant) -> list[dict]:
    """Phase 1: one call a case (compiles), compared with the reference; whether the Gluon kernel served it."""
    import torch

    from kimi_helix.kernels.mla import decode
    from kimi_helix.kernels.mla.naive import mla_decode_ref

    _apply(variant)
    served = []
    ok = decode._fp8_wgmma_ok
    decode._fp8_wgmma_ok = lambda *a: served.append(ok(*a)) or served[-1]
    rows = []
    for case in CASES:
        cache, q, cu = _case_setup(case)
        args = (q, cache.kv, cache.tables[0], cache.lens, cu, 192**-0.5, 512, None, cache.scale)
        t0 = time.perf_counter()
        out, lse = decode.mla_decode_triton(*args)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        want_out, want_lse = mla_decode_ref(*args)
        err = ((out.float() - want_out.float()).abs().max() / want_out.float().abs().max()).item()
        lse_err = (lse - want_lse).abs().max().item()
        rows.append(dict(case=list(case), served_gluon=bool(served and served[-1]), out_err=err, lse_err=lse_err,
                         first_call_s=round(first_s, 2), ok=bool(err < TOL and lse_err < 1e-2)))  # fmt: skip
        del cache
    return rows


def worker_time(variants, deadline: float) -> None:
    """Phase 2: time each variant at each case (cases outer: one cache at a time); a JSON line each, flushed."""
    import triton.testing

    from kimi_helix.kernels.mla import decode

    saved = _snapshot()
    for case in CASES:
        cache, q, cu = _case_setup(case)
        call = _timed_call(decode, cache, q, cu)
        for variant in variants:
            if time.time() > deadline:
                print(json.dumps(dict(variant=list(variant), case=list(case), error="budget")), flush=True)
                continue
            _restore(saved)
            _apply(variant)
            ms = triton.testing.do_bench(call, warmup=10, rep=80, return_mode="median")
            print(json.dumps(dict(variant=list(variant), case=list(case), ms=round(ms, 4))), flush=True)
        del cache, call
    _restore(saved)


def _snapshot() -> tuple:
    """The knobs `_apply` sets, for `_restore`."""
    from kimi_helix.kernels.mla import decode

    return decode.FP8_WGMMA, dict(decode.SCHEDULES)


def _restore(saved: tuple) -> None:
    """Put back a `_snapshot`. SCHEDULES is refilled in place: `choose_tiles` reads the dict that decode_schedule
    defines, and rebinding decode's name to a copy would leave every later variant timing the committed one."""
    from kimi_helix.kernels.mla import decode

    decode.FP8_WGMMA = saved[0]
    decode.SCHEDULES.clear()
    decode.SCHEDULES.update(saved[1])


def _timed_call(decode, cache, q, cu):
    """The case's call, over the cache's block tables in turn (latents beyond the L2 across calls)."""
    import itertools

    tables = itertools.cycle(cache.tables)
    return lambda: decode.mla_decode_triton(q, cache.kv, next(tables), cache.lens, cu, 192**-0.5, 512, None,
                                            cache.scale)  # fmt: skip


def _run(args: list[str], timeout: float) -> tuple[int | str, str, str]:
    try:
        run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout)
        return run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return "timeout", out, ""


def print_sm90(variants) -> None:
    """Compile each Gluon variant for sm_90 here (Triton's compiler, no GPU): decode (16 heads, split KV) and
    verify (4 heads x 4 tokens, one split, longest first)."""
    import kernel_resources as kr

    from kimi_helix.kernels.mla import decode

    for v in variants:
        if v[0] == "triton":
            continue
        p = decode.Fp8WgmmaParams(*v[:3], *v[4:])
        for name, kw in (("decode", dict(split=True)), ("verify", dict(block_h=4, split=False, longest_first=True))):
            usage = kr.resources(*kr.mla_fp8_wgmma_case(16, params=p, **kw)[1:6])
            print(json.dumps(dict(variant=list(v), kind=name, **usage)), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for tune_mla_fp8_wgmma.jsonl")
    ap.add_argument("--variants", nargs="+", type=parse_variant, default=[parse_variant(v) for v in VARIANTS])
    ap.add_argument("--jobs", type=int, default=8, help="phase-1 processes at a time")
    ap.add_argument("--variant-timeout", type=float, default=90, help="seconds a phase-1 process may take")
    ap.add_argument("--budget", type=float, default=200, help="seconds from the start by which phase 2 stops")
    ap.add_argument("--print-sm90", action="store_true", help="compile for sm_90 here and print resources")
    ap.add_argument("--worker-check", type=parse_variant, help=argparse.SUPPRESS)
    ap.add_argument("--worker-time", nargs="+", type=parse_variant, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_check:
        print(json.dumps(worker_check(args.worker_check)))
        return
    if args.worker_time:
        worker_time(args.worker_time, args.deadline)
        return
    if args.print_sm90:
        print_sm90(args.variants)
        return

    start = time.time()
    from bench_common import JsonlWriter, run_metadata

    meta = run_metadata()
    path = Path(args.out) / "tune_mla_fp8_wgmma.jsonl" if args.out else None
    passed = []
    with JsonlWriter(path, echo=sys.stderr) as results:

        def check(v):
            return v, _run(["--worker-check", ",".join(map(str, v))], args.variant_timeout)

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for v, (rc, out, err) in pool.map(check, args.variants):
                lines = [ln for ln in out.splitlines() if ln.startswith("[")]
                if rc != 0 or not lines:
                    results.write(dict(meta, phase="check", variant=list(v), error=f"rc={rc}: {err[-600:]}"))
                    continue
                rows = json.loads(lines[-1])
                for r in rows:
                    results.write(dict(meta, phase="check", variant=list(v), **r))
                gluon = v[0] != "triton"
                if all(r["ok"] and (r["served_gluon"] or not gluon) for r in rows):
                    passed.append(v)
        left = args.budget - (time.time() - start)
        times = {}
        if passed and left > 10:
            deadline = start + args.budget - 15
            rc, out, err = _run(["--worker-time", *(",".join(map(str, v)) for v in passed), "--deadline",
                                 str(deadline)], left - 3)  # fmt: skip
            for ln in out.splitlines():
                if ln.startswith("{"):
                    r = json.loads(ln)
                    results.write(dict(meta, phase="time", **r))
                    if "ms" in r:
                        times[(tuple(r["variant"]), tuple(r["case"]))] = r["ms"]
            if rc != 0:
                results.write(dict(meta, phase="time", error=f"rc={rc}: {err[-600:]}"))
    print(f"\n| variant (lookahead,wgs,regs,min_waves) | {' | '.join(map(str, CASES))} |")
    for v in args.variants:
        cells = [str(times.get((tuple(v), c), "-")) for c in CASES]
        print(f"| {','.join(map(str, v))}{'' if v in passed else ' (failed check)'} | {' | '.join(cells)} |")
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
