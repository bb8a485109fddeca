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
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import JsonlWriter, bench_ms, run_metadata  # noqa: E402

from kimi_helix.kernels.kda.chunk import chunk_kda  # noqa: E402
from kimi_helix.kernels.kda.naive import kda_gate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def flops(T: int, H: int, K: int, V: int, C: int = 64) -> float:
    return 2.0 * T * H * (3 * C * K + 2 * C * V + 3 * K * V)


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return None
    return fla_chunk_kda


def run_case(T: int, H: int, D: int, dtype: torch.dtype, device: torch.device, chunk_size: int):
    """Yields one row per backend, each as soon as it is timed."""
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
    for name, fn in backends.items():
        ms = bench_ms(fn, device, cpu_reps=2)
        row = dict(T=T, H=H, K=D, V=D, dtype=str(dtype).removeprefix("torch."), backend=name, ms=ms)
        row["tflops"] = flops(T, H, D, D) / ms / 1e9
        yield row


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
    meta = run_metadata()
    with JsonlWriter(args.out / "kda_prefill.jsonl") as out:
        for T, H in cases:
            for row in run_case(T, H, D, dtype, device, chunk_size):
                row = {**meta, **row}
                out.write(row)
                print(
                    f"T={T:6d} H={H:3d} K=V={D} {row['backend']:12s} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s"
                )
    return out.records


if __name__ == "__main__":
    main()
