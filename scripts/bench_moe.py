"""Benchmark the fused MoE experts (Triton: routed plus shared) against the weight-bandwidth and matmul floors.

    python scripts/bench_moe.py            # Kimi-Linear shapes: 256 experts, top-8, 1 shared, d=2304, I=1024, bf16
    python scripts/bench_moe.py --sweep    # also time a grid of tile configs per token count
    python scripts/bench_moe.py --smoke    # tiny shapes; runs on the CPU under the Triton interpreter

Routing is uniform: k distinct random experts per token, rotated over several routings so consecutive calls touch
other experts and the weights come from HBM rather than L2. Backends: `triton` timed by replaying a CUDA graph
(what a graph-captured decode step sees), `triton_eager` timed call by call (launch overhead included),
`triton_shared_apart` the routed kernels with the shared experts as a separate SwiGLU and add (three cuBLAS GEMMs,
silu_mul, add: how the MoE block ran them before they joined the kernels; graph-timed), and `torch_ref`, the
reference loop, for T <= 128 only. The weight floor is the bytes of the distinct experts a call touches (3 * d * I * 2
each, the shared experts included) over the copy bandwidth measured in the same run (a >= 1 GiB device-to-device
copy, read + write); the matmul floor is 2 * T * (k + shared) * 3 * d * I over the measured bf16 8192^3 matmul
rate. One JSON object per (tokens, backend) goes to <out>/moe.jsonl; a failing case is recorded with its error. A
markdown table ends it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import JsonlWriter, bench_ms, copy_tbps, matmul_tflops, run_metadata  # noqa: E402

from kimi_helix.kernels.moe import SharedExperts, fused_experts_ref  # noqa: E402
from kimi_helix.kernels.moe.triton import MoeConfig, fused_experts_triton  # noqa: E402
from kimi_helix.modeling.layers import SwiGLU  # noqa: E402

KIMI = dict(experts=256, top_k=8, d=2304, inter=1024, tokens=[1, 16, 64, 128, 4096])
SMOKE = dict(experts=8, top_k=2, d=32, inter=16, tokens=[1, 5])
REF_MAX_TOKENS = 128  # the reference is a Python loop over experts
ROUTINGS = 8
SWEEP = [
    MoeConfig(16, 32, 128, 64, 128, num_warps=4, num_stages=4),
    MoeConfig(16, 32, 128, 32, 128, num_warps=2, num_stages=4),
    MoeConfig(16, 16, 256, 32, 256, num_warps=4, num_stages=3),
    MoeConfig(16, 64, 128, 64, 128, num_warps=4, num_stages=4),
    MoeConfig(32, 64, 64, 64, 128, num_warps=4, num_stages=4),
    MoeConfig(64, 64, 64, 128, 64, num_warps=4, num_stages=3),
    MoeConfig(64, 128, 64, 256, 64, num_warps=8, num_stages=3),
    MoeConfig(128, 64, 64, 128, 64, num_warps=8, num_stages=3),
    MoeConfig(128, 128, 64, 256, 64, num_warps=8, num_stages=3),
    MoeConfig(128, 128, 64, 128, 64, num_warps=8, num_stages=4),
    # decode: the in-kernel combine (a GEMV: any column tile) at several widths and depths, narrower gate/up
    # tiles (more programs for 9 pairs), and the per-pair down kernel plus a sum
    MoeConfig(16, 16, 256, 4, 1024, num_warps=4, num_stages=4, sort_pairs=False),
    MoeConfig(16, 32, 128, 4, 1024, num_warps=4, num_stages=4, sort_pairs=False),
    MoeConfig(16, 16, 256, 2, 1024, num_warps=4, num_stages=4, sort_pairs=False),
    MoeConfig(16, 16, 256, 4, 512, num_warps=4, num_stages=4, sort_pairs=False),
    MoeConfig(16, 16, 256, 8, 512, num_warps=4, num_stages=4, sort_pairs=False),
    MoeConfig(16, 16, 256, 8, 256, num_warps=2, num_stages=4, sort_pairs=False),
    MoeConfig(16, 16, 256, 8, 1024, num_warps=8, num_stages=4, sort_pairs=False),
    MoeConfig(16, 16, 256, 16, 512, num_warps=4, num_stages=4, sort_pairs=False),
    MoeConfig(16, 16, 128, 4, 1024, num_warps=4, num_stages=6, sort_pairs=False),
    MoeConfig(16, 32, 128, 16, 512, num_warps=4, num_stages=4, sort_pairs=False),
    MoeConfig(16, 32, 128, 64, 128, num_warps=4, num_stages=4, sort_pairs=False, combine_in_down=False),
]


def sweeps(cfg: MoeConfig, tokens: int) -> bool:
    """Whether the sweep times `cfg` at `tokens`: unsorted re-reads an expert for every pair that picks it, so only
    for a few tokens, where sorting is not worth its launch; 64/128-row blocks are mostly padding at a decode's few
    pairs per expert."""
    if not cfg.sort_pairs:
        return tokens <= 8
    return tokens > 2 and (cfg.block_m <= 32 or tokens > 64)


def config_name(cfg: MoeConfig) -> str:
    return (
        f"m{cfg.block_m}_gu{cfg.block_n_gate_up}x{cfg.block_k_gate_up}_dn{cfg.block_n_down}x{cfg.block_k_down}"
        f"_w{cfg.num_warps}s{cfg.num_stages}{'' if cfg.sort_pairs else '_unsorted'}"
        f"{'' if cfg.combine_in_down or cfg.sort_pairs else '_pairsum'}"
    )


def make_call(backend, cfg, x, gate_up, down, shared, routings):
    """A no-argument call of one backend that takes the next routing on each call."""
    rotation = itertools.cycle(routings)
    if backend == "torch_ref":
        return lambda: fused_experts_ref(x, gate_up, down, *next(rotation), shared)
    if backend == "triton_shared_apart":
        swiglu = SwiGLU(x.shape[1], shared.gate.shape[0]).to(x.device, x.dtype)
        for linear, w in zip((swiglu.gate_proj, swiglu.up_proj, swiglu.down_proj), shared):
            linear.weight.data = w
        return lambda: fused_experts_triton(x, gate_up, down, *next(rotation)) + swiglu(x)
    return lambda: fused_experts_triton(x, gate_up, down, *next(rotation), shared, config=cfg)


def main(argv=None) -> list[dict]:
    """Run the benchmark; returns the records written."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter): checks it runs")
    ap.add_argument("--sweep", action="store_true", help="also time every tile config in SWEEP")
    ap.add_argument("--tokens", nargs="+", type=int, help="override the token counts")
    ap.add_argument("--shared", type=int, default=1, help="shared experts of intermediate I (default 1, as the 48B)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # the interpreter computes bf16 wrongly
    shape = SMOKE if args.smoke else KIMI
    E, k, d, inter = shape["experts"], shape["top_k"], shape["d"], shape["inter"]
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(E, 2 * inter, d, generator=gen) * d**-0.5).to(device, dtype)
    down = (torch.randn(E, d, inter, generator=gen) * inter**-0.5).to(device, dtype)
    shared = None
    if args.shared > 0:
        i_s = args.shared * inter
        gate, up = (torch.randn(2, i_s, d, generator=gen) * d**-0.5).to(device, dtype)
        shared = SharedExperts(gate, up, (torch.randn(d, i_s, generator=gen) * i_s**-0.5).to(device, dtype))
    expert_bytes = 3 * d * inter * gate_up.element_size()

    copy = copy_tbps(device, gib=1 / 1024 if args.smoke else 2)
    matmul = matmul_tflops(device, n=128 if args.smoke else 8192)
    base = dict(
        run_metadata(),
        experts=E,
        top_k=k,
        shared=args.shared,
        d=d,
        inter=inter,
        dtype=str(dtype).removeprefix("torch."),
        copy_tbps=round(copy, 3),
        matmul_tflops=round(matmul, 1),
    )
    # Appended case by case: a killed run keeps what it measured.
    with JsonlWriter(Path(args.out) / "moe.jsonl", echo=sys.stderr) as results:
        for T in args.tokens or shape["tokens"]:
            x = torch.randn(T, d, generator=gen).to(device, dtype)
            routings = []
            for _ in range(ROUTINGS):
                ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k]
                routings.append(((torch.rand(T, k, generator=gen) + 0.1).to(device), ids.to(device)))
            touched = statistics.mean(ids.unique().numel() for _, ids in routings) + args.shared
            weight_bytes = touched * expert_bytes
            flops = 2 * T * (k + args.shared) * 3 * d * inter
            bw_floor_ms = weight_bytes / copy / 1e9
            mm_floor_ms = flops / matmul / 1e9
            runs = [("triton", None, True), ("triton_eager", None, False)]
            if shared is not None:
                runs.append(("triton_shared_apart", None, True))
            if T <= REF_MAX_TOKENS:
                runs.append(("torch_ref", None, False))
            if args.sweep:
                runs += [(f"triton:{config_name(c)}", c, True) for c in SWEEP if sweeps(c, T)]
            for backend, cfg, graph in runs:
                rec = dict(base, tokens=T, backend=backend, experts_touched=touched, ms=None)
                try:
                    call = make_call(backend, cfg, x, gate_up, down, shared, routings)
                    ms = bench_ms(call, device, graph=graph)
                    rec.update(
                        ms=round(ms, 4),
                        tbps_weights=round(weight_bytes / ms / 1e9, 3),
                        pct_of_bw_floor=round(100 * bw_floor_ms / ms, 1),
                        tflops=round(flops / ms / 1e9, 2),
                        pct_of_mm_floor=round(100 * mm_floor_ms / ms, 1),
                        bw_floor_ms=round(bw_floor_ms, 4),
                        mm_floor_ms=round(mm_floor_ms, 4),
                        timing="cuda_graph" if graph and device.type == "cuda" else "per_call",
                        error=None,
                    )
                except Exception as err:  # a failing case is recorded, the rest still run
                    rec["error"] = f"{type(err).__name__}: {err}"[:500]
                results.write(rec)

    records = results.records
    print(f"\n{base['gpu']}: copy {copy:.2f} TB/s, bf16 matmul {matmul:.0f} TFLOP/s\n")
    print("| tokens | backend | experts | ms | weight TB/s | % bw floor | TFLOP/s | % mm floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        if r["error"]:
            print(f"| {r['tokens']} | {r['backend']} | | error: {r['error'][:60]} | | | | |")
        else:
            print(f"| {r['tokens']} | {r['backend']} | {r['experts_touched']:.1f} | {r['ms']:.4f} | "
                  f"{r['tbps_weights']:.2f} | {r['pct_of_bw_floor']:.1f} | {r['tflops']:.1f} | "
                  f"{r['pct_of_mm_floor']:.1f} |")  # fmt: skip
    return records


if __name__ == "__main__":
    main()
