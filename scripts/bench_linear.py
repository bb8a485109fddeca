"""Decode-sized `linear` (1-16 rows) of the Triton kernel against the GEMM library (`F.linear`) at the projection
shapes of a model preset, in TB/s of weight bytes.

    python scripts/bench_linear.py                        # kimi-linear-48b-a3b projections, rows 1, 4, 16
    python scripts/bench_linear.py --tiles 16x256x4x4,32x256x4x3   # BLOCK_N x BLOCK_K x warps x stages
    python scripts/bench_linear.py --rows 1 --splits 1,2,4,8 --only kda.o,mla.kv_a   # K splits against the choice
    python scripts/bench_linear.py --device cpu --preset tiny --rows 1   # CPU smoke run (the interpreter)

Each timed call runs the projection over a ring of distinct weights larger than the L2 cache, so every weight byte
comes from HBM as it does in a decode step, captured in a CUDA graph and replayed as the engine's decode step is;
the time is per projection. Each tile runs with the automatic K splits (`split_count`, shown as "auto splits") and
with each of --splits (1: unsplit). Rows go to benchmarks/results/linear.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch.nn.functional as F  # noqa: E402
from bench_common import JsonlWriter, bench_ms, copy_tbps, run_metadata  # noqa: E402

from kimi_helix.kernels.launch import cdiv  # noqa: E402
from kimi_helix.kernels.linear.triton import Tile, default_tile, linear_triton, split_count  # noqa: E402
from kimi_helix.presets import get_preset  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "linear.jsonl"
RING_BYTES = 256 << 20  # several times the H200's 50 MB L2


def projections(preset: str) -> dict[str, list[tuple[int, int]]]:
    """name -> the [N, K] weights one call multiplies (several: one launch writing them side by side)."""
    c = get_preset(preset)
    d, p, r = c.hidden_size, c.kda_num_heads * c.kda_head_dim, c.kda_head_dim
    q_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    return {
        "kda.qkv": [(p, d)] * 3,
        "kda.q": [(p, d)],
        "kda.o": [(d, p)],
        "kda.f_a+g_a": [(r, d), (r, d)],
        "kda.f_b": [(p, r)],
        "mla.q": [(c.num_attention_heads * q_head, d)],
        "mla.kv_a": [(c.kv_lora_rank + c.qk_rope_head_dim, d)],
        "mla.o": [(d, c.num_attention_heads * c.v_head_dim)],
        "shared.gate+up": [(c.moe_intermediate_size * c.num_shared_experts, d)] * 2,
        "shared.down": [(d, c.moe_intermediate_size * c.num_shared_experts)],
    }


def parse_tile(text: str) -> Tile:
    n, k, w, s = (int(v) for v in text.split("x"))
    return Tile(block_n=n, block_k=k, num_warps=w, num_stages=s)


def auto_splits(shapes: list[tuple[int, int]], tile: Tile | None, dtype: torch.dtype, device) -> int:
    """The K splits `linear_triton` picks for one launch of `shapes` with `tile` (None: its default tile)."""
    tile = tile or default_tile(sum(n for n, _ in shapes), device.index)
    tiles = sum(cdiv(n, tile.block_n) for n, _ in shapes)
    return split_count(tiles, shapes[0][1], tile, dtype.itemsize, device.index)


def bench_shape(row: dict, x, weights, variants, nbytes: int, device) -> list[str]:
    """Times one projection over the ring of `weights` with the library and each (name, tile, splits) variant
    into `row`; returns the table cells (us and TB/s per implementation)."""
    ref = torch.cat([F.linear(x, w) for w in weights[0]], -1).float()
    graph = device.type == "cuda"  # replayed, so the time is the GPU's and not the launches' (~10-30 us each)
    ms = bench_ms(lambda: [[F.linear(x, w) for w in ws] for ws in weights], device, graph) / len(weights)
    row["cublas_us"] = round(ms * 1e3, 2)
    cells = [f"{ms * 1e3:.2f} | {nbytes / ms / 1e9:.2f}"]
    if graph:  # the other BLAS front end torch can call: it picks its kernels by other heuristics
        default = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        ms = bench_ms(lambda: [[F.linear(x, w) for w in ws] for ws in weights], device, graph) / len(weights)
        torch.backends.cuda.preferred_blas_library(default)
        row["cublaslt_us"] = round(ms * 1e3, 2)
        cells.append(f"{ms * 1e3:.2f} | {nbytes / ms / 1e9:.2f}")
    for name, tile, splits in variants:
        err = (linear_triton(x, weights[0], tile, splits).float() - ref).norm() / ref.norm()
        ms = bench_ms(lambda t=tile, s=splits: [linear_triton(x, ws, t, s) for ws in weights], device, graph)
        ms /= len(weights)
        row[f"triton_{name}_us"], row[f"triton_{name}_rel_err"] = round(ms * 1e3, 2), float(f"{err:.2e}")
        cells.append(f"{ms * 1e3:.2f} | {nbytes / ms / 1e9:.2f}")
    return cells


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="kimi-linear-48b-a3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", default="1,4,16", help="comma-separated rows per call (default: 1,4,16)")
    p.add_argument("--tiles", default="", help="BLOCK_N x BLOCK_K x warps x stages, comma-separated, beside the "
                   "kernel's own choice")  # fmt: skip
    p.add_argument("--splits", default="1", help="comma-separated K splits timed beside the automatic ones for "
                   "each tile (1: unsplit; default: 1; '' for none)")  # fmt: skip
    p.add_argument("--only", default="", help="comma-separated projection names (default: all)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tile_names = ["default", *filter(None, args.tiles.split(","))]
    tiles = [None, *(parse_tile(t) for t in tile_names[1:])]
    split_list = [None, *(int(s) for s in filter(None, args.splits.split(",")))]
    variants = [
        (t_name if s is None else f"{t_name}_s{s}", tile, s)
        for t_name, tile in zip(tile_names, tiles)
        for s in split_list
    ]
    names = [v[0] for v in variants]
    only = set(filter(None, args.only.split(",")))
    meta = run_metadata() | {"preset": args.preset}
    if device.type == "cuda":
        meta["copy_tbps"] = round(copy_tbps(device), 3)
    print(f"{args.preset} projections, {dtype}, copy bandwidth {meta.get('copy_tbps', '-')} TB/s")
    head = " | ".join(f"{t} us | TB/s" for t in names)
    lt = "cuBLASLt us | TB/s | " if device.type == "cuda" else ""
    print(f"| projection | rows | auto splits | cuBLAS us | TB/s | {lt}{head} |")
    with JsonlWriter(args.out) as out:
        for name, shapes in projections(args.preset).items():
            if only and name not in only:
                continue
            splits = "/".join(str(auto_splits(shapes, tile, dtype, device)) for tile in tiles)
            nbytes = sum(n * k for n, k in shapes) * dtype.itemsize
            ring = max(1, min(64, RING_BYTES // nbytes)) if device.type == "cuda" else 1
            weights = [[torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for n, k in shapes] for _ in range(ring)]
            for rows in (int(r) for r in args.rows.split(",")):
                row = dict(meta, projection=name, rows=rows, weight_mb=round(nbytes / 1e6, 2), auto_splits=splits)
                x = torch.randn(rows, shapes[0][1], device=device, dtype=dtype)
                cells = bench_shape(row, x, weights, variants, nbytes, device)
                out.write(row)
                print(f"| {name} | {rows} | {splits} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
