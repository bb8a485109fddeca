"""Triton merge of split-KV partials by log-sum-exp (`combine.combine_partials_ref`'s maths): the second kernel of
split-KV MLA decode (`decode.mla_decode_triton`) and the Triton backend of `combine.combine_partials`.

Each program merges BLOCK_R rows x BLOCK_D columns, reading every split of them in one load rather than one split
after another: a launch of few rows (decode at batch 1) then still spreads over the SMs, and its time is one
round trip to memory rather than one a split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.launch import cdiv, next_pow2

__all__ = ["combine_launch", "launch_combine", "mla_decode_combine_kernel"]

# Elements of the [BLOCK_R, splits, BLOCK_D] tile a program loads: 64 fp32 registers a thread at 4 warps.
_TILE_ELEMS = 8192
# Programs per SM below which a launch does not take more rows a program.
_MIN_PROGRAMS_PER_SM = 4


@triton.jit
def mla_decode_combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    num_rows,
    num_splits,
    DC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
):
    """part_out [num_rows, num_splits, DC] fp32 and part_lse [num_rows, num_splits] fp32 (natural log) -> out
    [num_rows, DC] (out_ptr's dtype), lse [num_rows]; program (i, j) merges rows [i * BLOCK_R, ...) and columns
    [j * BLOCK_D, ...). A split that saw no key has lse -inf and weight 0; a row whose splits all saw none stays
    zero with lse -inf."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    rows = rows.to(tl.int64)
    split = tl.arange(0, SPLITS_POW2)
    part = rows[:, None] * num_splits + split[None, :]  # [BLOCK_R, SPLITS_POW2]
    part_ok = row_ok[:, None] & (split < num_splits)[None, :]
    part_lse = tl.load(part_lse_ptr + part, mask=part_ok, other=float("-inf"))
    m = tl.max(part_lse, axis=1)
    m_off = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(part_lse - m_off[:, None])
    denom = tl.sum(w, axis=1)
    has_keys = denom > 0
    denom = tl.where(has_keys, denom, 1.0)
    dc = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    vals = tl.load(part_out_ptr + part[:, :, None] * DC + dc[None, None, :], mask=part_ok[:, :, None], other=0.0)
    out = tl.sum(w[:, :, None] * vals, axis=1) / denom[:, None]
    tl.store(out_ptr + rows[:, None] * DC + dc[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + rows, tl.where(has_keys, m_off + tl.log(denom), float("-inf")), mask=row_ok)


def combine_launch(num_rows: int, num_splits: int, dc: int, num_sms: int) -> tuple[tuple[int, int], dict]:
    """(grid, constexprs) of `mla_decode_combine_kernel` from shapes alone (no device reads): every split of a row
    in one tile of at most _TILE_ELEMS elements (fewer columns a program as the splits grow), and more rows a
    program only while the launch keeps _MIN_PROGRAMS_PER_SM programs an SM. dc is a power of two."""
    splits_pow2 = next_pow2(num_splits)
    block_d = min(dc, max(16, _TILE_ELEMS // splits_pow2))
    col_blocks = cdiv(dc, block_d)
    block_r = 1
    while (
        2 * block_r * splits_pow2 * block_d <= _TILE_ELEMS
        and cdiv(num_rows, 2 * block_r) * col_blocks >= _MIN_PROGRAMS_PER_SM * num_sms
    ):
        block_r *= 2
    grid = (cdiv(num_rows, block_r), col_blocks)
    return grid, dict(DC=dc, BLOCK_R=block_r, BLOCK_D=block_d, SPLITS_POW2=splits_pow2)


def launch_combine(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   num_sms: int) -> None:  # fmt: skip
    """Merge part_out [..., S, DC] fp32 and part_lse [..., S] fp32 (contiguous, the leading dims as rows) into out
    [..., DC] and lse [...], on the GPU or under the Triton interpreter."""
    num_splits, dc = part_out.shape[-2], part_out.shape[-1]
    num_rows = part_lse.numel() // max(num_splits, 1)
    grid, meta = combine_launch(num_rows, num_splits, dc, num_sms)
    mla_decode_combine_kernel[grid](part_out, part_lse, out, lse, num_rows, num_splits, **meta)
