"""Triton `linear` for few rows: decode steps multiply one to sixteen tokens by each projection, where the GEMM
libraries pick tiles that leave most SMs idle (their M=1 kernels reached 0.35-3.4 TB/s in docs/benchmarks.md's
decode profile). Each program owns BLOCK_N output columns of every row and streams its weight rows once; several
weights that read the same x share one launch and write their outputs side by side (no concatenation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import num_sms, triton_devices
from kimi_helix.kernels.launch import cdiv

__all__ = ["CAPS", "MAX_ROWS", "MAX_WEIGHTS", "Tile", "linear_triton"]

# One BLOCK_M tile of rows per program: the kernel serves at most MAX_ROWS rows (larger batches go to the GEMM
# library, whose tiles fit them); up to MAX_WEIGHTS weights per launch.
MAX_ROWS = 16
MAX_WEIGHTS = 3
CAPS = OpCaps(triton_devices(), FLOATS, max_rows=MAX_ROWS)


@dataclass(frozen=True)
class Tile:
    """Launch shape: the column tile (None: `block_n`), the K step, warps and pipeline stages."""

    block_n: int | None = None
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def linear_kernel(
    x, w0, w1, w2, out, M, K, N0, N1, N2, TILES0, TILES1, stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # the program's weight, its column tile in that weight, and where that weight's outputs start in `out`
    if pid < TILES0:
        w, n_w, tile, col0 = w0, N0, pid, 0
    elif pid < TILES0 + TILES1:
        w, n_w, tile, col0 = w1, N1, pid - TILES0, N0
    else:
        w, n_w, tile, col0 = w2, N2, pid - TILES0 - TILES1, N0 + N1
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < n_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w + cols[:, None].to(tl.int64) * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PRECISION)
    dst = out + rows[:, None] * stride_om + col0 + cols[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_n(total_cols: int, device_index: int | None) -> int:
    """The widest column tile (128 down to 16) that still gives every SM a program: a decode GEMV is bound by the
    bytes in flight, so idle SMs cost more than narrow tiles."""
    sms = num_sms(device_index)
    for width in (128, 64, 32):
        if cdiv(total_cols, width) >= sms:
            return width
    return 16


def linear_triton(x: torch.Tensor, weights: torch.Tensor | Sequence[torch.Tensor], tile: Tile = Tile()) -> torch.Tensor:
    """Triton form of :func:`kimi_helix.kernels.linear.naive.linear_ref` (same arguments and result).

    Args:
        x: [..., K] fp32/fp16/bf16 with at most MAX_ROWS rows (the product of the leading dims); the last dim
            contiguous.
        weights: one [N, K] weight or up to MAX_WEIGHTS [N_i, K] weights, contiguous, of x's dtype and device.
        tile: the launch shape (scripts/bench_linear.py compares them).

    Returns:
        [..., sum N_i] contiguous, in x's dtype (fp32 accumulation).
    """
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if not 1 <= len(ws) <= MAX_WEIGHTS:
        raise ValueError(f"weights must be 1 to {MAX_WEIGHTS} tensors, got {len(ws)}")
    k = x.shape[-1]
    for i, w in enumerate(ws):
        if w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous():
            raise ValueError(
                f"weights[{i}] must be a contiguous [N, {k}] {x.dtype} tensor on {x.device}, got {w.dtype} "
                f"{list(w.shape)} on {w.device}"
            )
    check_triton_device("x", x)
    x2 = x.reshape(-1, k)
    if x2.shape[0] > MAX_ROWS:
        raise ValueError(f"x has {x2.shape[0]} rows; the Triton linear serves at most {MAX_ROWS}")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    ns = [w.shape[0] for w in ws]
    out = torch.empty(*x.shape[:-1], sum(ns), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or sum(ns) == 0:
        return out
    if k == 0:
        return out.zero_()
    width = tile.block_n or block_n(sum(ns), x.device.index)
    tiles = [cdiv(n, width) for n in ns]
    ws += [ws[0]] * (MAX_WEIGHTS - len(ws))
    ns += [0] * (MAX_WEIGHTS - len(ns))
    tiles += [0] * (MAX_WEIGHTS - len(tiles))
    linear_kernel[(sum(tiles),)](
        x2, *ws, out, x2.shape[0], k, *ns, tiles[0], tiles[1], x2.stride(0), sum(ns),
        BLOCK_M=MAX_ROWS, BLOCK_N=width, BLOCK_K=tile.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out
