"""Benchmark the Triton chunked KDA prefill (and fla's chunk_kda on the same inputs, when fla is importable).

    python scripts/bench_kda_prefill.py                 # B=1, T in {2048, 8192, 16384}, H in {32, 64, 96}, K=V=128
    python scripts/bench_kda_prefill.py --T 8192 --H 64 # one case (the perf target: <= 1.2 ms on an H200)
    python scripts/bench_kda_prefill.py --smoke         # tiny shapes; runs on the CPU under the Triton interpreter

Inputs are bf16 q, k, v, beta and an fp32 log-decay g, with the L2 norm of q and k in the kernel and the final
state returned, as the model calls it. Backends: ``triton`` (g given), ``triton_gate`` (raw gate pre-activation
with A_log/dt_bias and lower_bound -5, the K3 path with the bounded-gate fast diagonal) and ``fla``.
``tflops`` counts the chunked algorithm's matmuls with C = 64 per token and head, dense (causal halves included):
2 (3 C K + 2 C V + 3 K V), i.e. A_kk, A_qk, w, u, o-intra, w S, kg^T v_new and q S.
One JSON object per case and backend goes to <out>/kda_prefill.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from kimi_helix.kernels.kda.chunk import chunk_kda  # noqa: E402
from kimi_helix.kernels.kda.naive import kda_gate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def bench(fn, device: torch.device) -> float:
    """Median milliseconds of fn(): do_bench's CUDA events on the GPU, wall clock (few reps) on the CPU."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def flops(T: int, H: int, K: int, V: int, C: int = 64) -> float:
    return 2.0 * T * H * (3 * C * K + 2 * C * V + 3 * K * V)


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return None
    return fla_chunk_kda


def run_case(T: int, H: int, D: int, dtype: torch.dtype, device: torch.device, chunk_size: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    q, k, v, f = rnd(1, T, H, D), rnd(1, T, H, D), rnd(1, T, H, D), rnd(1, T, H, D)
    beta = torch.sigmoid(rnd(1, T, H))
    A_log, dt_bias = rnd(H, dt=torch.float32) * 0.5, rnd(H * D, dt=torch.float32) * 0.5 - 1.0
    g = kda_gate(f, A_log, dt_bias)
    common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    backends = {
        "triton": lambda: chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, **common),
        "triton_gate": lambda: chunk_kda(
            q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, chunk_size=chunk_size, **common
        ),
    }
    fla_chunk_kda = _fla_chunk_kda()
    if fla_chunk_kda is not None and device.type == "cuda":
        backends["fla"] = lambda: fla_chunk_kda(q, k, v, g, beta, **common)
    rows = []
    for name, fn in backends.items():
        ms = bench(fn, device)
        rows.append(dict(T=T, H=H, K=D, V=D, dtype=str(dtype).removeprefix("torch."), backend=name, ms=ms))
        rows[-1]["tflops"] = flops(T, H, D, D) / ms / 1e9
    return rows


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter when there is no GPU)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="directory for the JSONL")
    p.add_argument("--T", default="2048,8192,16384", help="comma-separated sequence lengths")
    p.add_argument("--H", default="32,64,96", help="comma-separated head counts")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:  # the interpreter garbles bf16, so the CPU smoke run uses fp16
        cases, dtype, D, chunk_size = [(40, 2)], torch.float16, 16, 16
    else:
        cases = [(t, h) for t in map(int, args.T.split(",")) for h in map(int, args.H.split(","))]
        dtype, D, chunk_size = torch.bfloat16, 128, 64
    meta = dict(
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=_commit(),
    )
    rows = []
    for T, H in cases:
        for row in run_case(T, H, D, dtype, device, chunk_size):
            rows.append({**meta, **row})
            print(f"T={T:6d} H={H:3d} K=V={D} {row['backend']:12s} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "kda_prefill.jsonl", "a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
