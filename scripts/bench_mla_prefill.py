"""Benchmark the Triton MLA prefill kernel; appends one JSON line per case to benchmarks/results/mla_prefill.jsonl.

Usage (GPU, from the repo root): python scripts/bench_mla_prefill.py [--dtype bf16] [--heads 32 64] [--check]
                                     [--cases NAME ...] [--sweep] [--commit SHA] [--out PATH]
       (CPU smoke test):         python scripts/bench_mla_prefill.py --smoke [--out PATH]

Each record carries gpu, date, commit, torch/triton versions and the case: the (Tq_i, Tk_i) of its sequences,
heads, dims, dtype, the tile config, kernel_ms (median GPU time of the launch from CUDA events) and the TFLOP/s it
implies (causal flops actually needed: each query times its visible keys times 2 * (Dqk + Dv)); with the kernel's
own config also ms (the public call end to end, validation sync included), for prefix-free single sequences
sdpa_ms (torch SDPA, is_causal) as a baseline, and with --check the relative errors against the torch reference.
--sweep times every tile config that fits instead (kernel only). --smoke runs one tiny case under the Triton
interpreter, checks it against the reference and writes nothing unless --out is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import JsonlWriter, run_metadata  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "mla_prefill.jsonl"

# name -> list of (Tq_i, Tk_i): whole prompts, chunked-prefill continuations over a long prefix, and a ragged batch.
CASES = {
    "single_4k": [(4096, 4096)],
    "single_16k": [(16384, 16384)],
    "single_32k": [(32768, 32768)],
    "chunk_2k_after_30k": [(2048, 32768)],
    "batch_8x1k": [(1024, 1024)] * 8,
    "ragged_mix": [(3000, 3000), (2048, 4096), (777, 5000), (1, 1), (0, 300), (1500, 1700)],
}
SMOKE_CASES = {"smoke": [(5, 5), (7, 40), (0, 3), (20, 20)]}


def causal_flops(pairs, heads: int, dqk: int, dv: int) -> int:
    """Flops of the visible (query, key) pairs only: sum_j (prefix + j + 1) pairs per sequence and head."""
    pairs_seen = sum(tq * (tk - tq) + tq * (tq + 1) // 2 for tq, tk in pairs)
    return 2 * heads * pairs_seen * (dqk + dv)


def make_inputs(pairs, heads, dqk, dv, dtype, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    tq, tk = sum(p[0] for p in pairs), sum(p[1] for p in pairs)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    cu = [torch.tensor([0] + [p[i] for p in pairs], device=device).cumsum(0).to(torch.int32) for i in (0, 1)]
    return rnd(tq, heads, dqk), rnd(tk, heads, dqk), rnd(tk, heads, dv), cu[0], cu[1]


def time_ms(fn, device: str, reps: int) -> float:
    """Median wall time of fn() in ms, host work included (CUDA-synchronised on the GPU)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()  # compile / warm up
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def gpu_ms(fn) -> float:
    """Median GPU time of fn() in ms from CUDA events (triton's do_bench: warm-up, L2 flushed between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sweep_configs(dtype_bytes: int, dqk: int, dv: int):
    """Tile configs worth timing: those whose shared memory fits the H100/H200's 227 KB per block."""
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3, 4):
                    if dtype_bytes * (bm * dqk + stages * bn * (dqk + dv)) <= 227 * 1024:
                        yield bm, bn, warps, stages


def run_case(name, pairs, heads, dqk, dv, dtype_name, device, reps, check, configs):
    """Yields one record per tile config as soon as it is measured (configs None: the kernel's own choice, timed end
    to end as well)."""
    import torch

    from kimi_helix.kernels.mla import prefill
    from kimi_helix.kernels.mla.naive import mla_prefill_ref

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    q, k, v, cu_q, cu_k = make_inputs(pairs, heads, dqk, dv, dtype, device)
    scale = 192**-0.5
    splits = prefill._validate(q, k, v, cu_q, cu_k)
    base = {
        "case": name,
        "pairs": [list(p) for p in pairs],
        "tq": q.shape[0],
        "tk": k.shape[0],
        "heads": heads,
        "dqk": dqk,
        "dv": dv,
        "dtype": dtype_name,
    }
    flops = causal_flops(pairs, heads, dqk, dv)

    def measure(config):
        def launch():
            return prefill._launch(q, k, v, cu_q, cu_k, scale, splits, config)

        kernel_ms = gpu_ms(launch) if device == "cuda" else time_ms(launch, device, reps)
        rec = {**base, "config": list(config), "kernel_ms": round(kernel_ms, 4)}
        rec["tflops"] = round(flops / (kernel_ms * 1e-3) / 1e12, 2)
        return rec

    if configs is not None:
        yield from map(measure, configs)
        return
    rec = measure(prefill.tile_config(dtype, dqk, dv))
    # The public call adds validation (one device sync) and the Python around the launch.
    rec["ms"] = round(time_ms(lambda: prefill.mla_prefill_triton(q, k, v, cu_q, cu_k, scale), device, reps), 4)
    if device == "cuda" and len(pairs) == 1 and pairs[0][0] == pairs[0][1]:
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        rec["sdpa_ms"] = round(gpu_ms(lambda: sdpa(qs, ks, vs, is_causal=True, scale=scale)), 4)
    # The reference materialises [H, Tq_i, Tk_i] fp32 scores: skip it where that would not fit.
    if check and max(tq * tk for tq, tk in pairs) * heads * 4 < 16e9:
        out, lse = prefill.mla_prefill_triton(q, k, v, cu_q, cu_k, scale)
        ref_out, ref_lse = mla_prefill_ref(q, k, v, cu_q, cu_k, scale)
        rec["rel_err"] = ((out.double() - ref_out.double()).norm() / ref_out.double().norm()).item()
        rec["lse_rel_err"] = ((lse.double() - ref_lse.double()).norm() / ref_lse.double().norm()).item()
    yield rec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny case on the CPU under the Triton interpreter")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--heads", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--check", action="store_true", help="also report the error against the torch reference")
    parser.add_argument("--sweep", action="store_true", help="time every tile config that fits (kernel only)")
    parser.add_argument(
        "--commit", default=None, help="commit to record (default: $KIMI_HELIX_COMMIT, else git rev-parse HEAD)"
    )
    parser.add_argument("--out", type=Path, default=None, help=f"JSONL to append to (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel module's import (triton.jit reads it)
    import torch
    import triton

    if args.smoke:
        device, cases, heads, dtype, reps, check, out = "cpu", SMOKE_CASES, [2], "fp32", 1, True, args.out
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: use --smoke on the CPU")
        device, heads, dtype, reps, check = "cuda", args.heads, args.dtype, args.reps, args.check
        cases, out = {name: CASES[name] for name in args.cases}, args.out or DEFAULT_OUT
    meta = {**run_metadata(), "torch": torch.__version__, "triton": triton.__version__}
    if args.commit:
        meta["commit"] = args.commit
    # Appended case by case: a killed run keeps what it measured.
    with JsonlWriter(out, echo=sys.stdout) as results:
        for h in heads:
            for name, pairs in cases.items():
                dims = (48, 16) if args.smoke else (192, 128)
                configs = list(sweep_configs(2 if dtype != "fp32" else 4, *dims)) if args.sweep else None
                for record in run_case(name, pairs, h, *dims, dtype, device, reps, check, configs):
                    results.write({**meta, **record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
