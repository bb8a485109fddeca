"""Benchmark fused recurrent KDA decode against the state-traffic floor.

    python scripts/bench_kda_decode.py                  # N in {1, 64, 256}, H=32, K=V=128 (H200: well under a minute)
    python scripts/bench_kda_decode.py --tokens 1,4     # also verify (k + 1 = 4 tokens per sequence)
    python scripts/bench_kda_decode.py --sweep          # also every (BV, num_warps) in SWEEP, to retune _config
    python scripts/bench_kda_decode.py --smoke          # tiny shapes; runs on the CPU under the Triton interpreter

Decode is a state copy with a little arithmetic: each step reads and writes every sequence's fp32 state
[H, K, V] once, 2 * N * H * K * V * 4 bytes, while q, k, v, the gate and o are a few hundred times smaller. So TB/s
counts the state traffic only and is compared with a >= 1 GiB device-to-device copy (read + write) timed in the same
run; ``floor_ms`` is the state bytes over that copy bandwidth. The states live in a pool with scattered slots and
are updated in place, and the gate is computed in the kernel from bf16 pre-activations, as the engine calls it.
One JSON object per case goes to <out>/kda_decode.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import JsonlWriter, bench_ms, copy_tbps, run_metadata  # noqa: E402

from kimi_helix.kernels.kda import fused_recurrent as fr  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SWEEP = [(bv, nw) for bv in (16, 32, 64) for nw in (2, 4, 8)]  # (BV, num_warps)


@contextlib.contextmanager
def forced_config(config: tuple[int, int] | None):
    """Run the kernel with a fixed (BV, num_warps) instead of the choice of fused_recurrent._config."""
    chosen = fr._config
    if config is not None:
        fr._config = lambda N, H, V: config
    try:
        yield
    finally:
        fr._config = chosen


def run_case(n: int, h: int, d: int, t: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Time one decode (t = 1) or verify (t > 1) step of n sequences over a pool of 2n slots."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    q, k, v, f = rnd(n, t, h, d), rnd(n, t, h, d), rnd(n, t, h, d), rnd(n, t, h, d)
    beta = torch.sigmoid(rnd(n, t, h))
    A_log, dt_bias = rnd(h, dt=torch.float32) * 0.5, rnd(h * d, dt=torch.float32) * 0.5 - 1.0
    pool = rnd(2 * n, h, d, d, dt=torch.float32) * 0.1
    slots = torch.randperm(2 * n, generator=gen, device=device)[:n]

    def step():
        fr.fused_recurrent_kda(
            q, k, v, f, beta, initial_state=pool, state_indices=slots, output_final_state=True,
            use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        )  # fmt: skip

    ms = bench_ms(step, device)
    state_bytes = 2 * n * h * d * d * 4
    bv, num_warps = fr._config(n, h, d)
    return dict(
        n=n, h=h, k=d, v=d, t=t, dtype=str(dtype).removeprefix("torch."), bv=bv, num_warps=num_warps,
        ms=ms, tbps=state_bytes / ms / 1e9,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter when there is no GPU)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="directory for the JSONL")
    p.add_argument("--ns", default="1,64,256", help="comma-separated sequence counts")
    p.add_argument("--tokens", default="1", help="comma-separated tokens per sequence (1 = decode)")
    p.add_argument("--sweep", action="store_true", help="also time every (BV, num_warps) in SWEEP")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        cases = [(1, 2, 16, 1), (3, 2, 16, 2)]
    else:
        cases = [(n, 32, 128, t) for t in map(int, args.tokens.split(",")) for n in map(int, args.ns.split(","))]
    copy = copy_tbps(device, gib=1 / 1024 if args.smoke else 2)
    meta = run_metadata()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    with JsonlWriter(args.out / "kda_decode.jsonl") as out:
        for config in [None, *SWEEP] if args.sweep else [None]:
            for n, h, d, t in cases:
                with forced_config(config):
                    row = {**meta, **run_case(n, h, d, t, dtype, device)}
                row["config"] = "auto" if config is None else "forced"
                row.update(copy_tbps=copy, floor_ms=2 * n * h * d * d * 4 / copy / 1e9)
                row["pct_of_copy"] = 100 * row["tbps"] / copy
                out.write(row)
                print(
                    f"N={n:4d} H={h} K=V={d} T={t} BV={row['bv']:3d} warps={row['num_warps']} ({row['config']}): "
                    f"{row['ms'] * 1e3:9.1f} us  {row['tbps']:.2f} TB/s state ({row['pct_of_copy']:.0f}% of copy "
                    f"{copy:.2f} TB/s, floor {row['floor_ms'] * 1e3:.1f} us)"
                )
    return out.records


if __name__ == "__main__":
    main()
