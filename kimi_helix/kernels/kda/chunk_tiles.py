"""Tile helpers shared by the Triton KDA prefill kernels: a chunk's span in the packed tokens, and masked loads
and stores of row-major tiles (zero outside the valid rows and columns)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_span(cu_seqlens, chunk_indices, i_c, BT: tl.constexpr):
    """(t0, T) of chunk i_c: its first packed token (int64) and its number of valid rows (int32, <= BT)."""
    i_n, i_t = tl.load(chunk_indices + 2 * i_c), tl.load(chunk_indices + 2 * i_c + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    return t0, tl.minimum(eos - t0, BT).to(tl.int32)


@triton.jit
def load_tile(ptr, r0, c0, T, D: tl.constexpr, stride, BR: tl.constexpr, BD: tl.constexpr):
    """[BR, BD] fp32 tile at (r0, c0) of a row-major [T, D] view with row stride `stride`; zero outside."""
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BD)
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_row(ptr, r, c0, stride, D: tl.constexpr, BD: tl.constexpr):
    """Columns c0 .. c0+BD of row r (which must exist) as fp32, zero past column D."""
    cols = c0 + tl.arange(0, BD)
    return tl.load(ptr + r * stride + cols, mask=cols < D, other=0.0).to(tl.float32)


@triton.jit
def store_tile(ptr, x, r0, c0, T, D: tl.constexpr, stride, BR: tl.constexpr, BD: tl.constexpr):
    """Stores the [BR, BD] tile x at (r0, c0) of a row-major [T, D] view, in ptr's dtype, inside it only."""
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BD)
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)
