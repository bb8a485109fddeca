"""Triton helpers shared by the varlen kernels (short conv, KDA): where a sequence or a chunk lies in the packed
input, and which state slot it owns. One copy, so the conv, recurrent and chunked kernels cannot drift apart."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["chunk_span", "sequence_span"]


@triton.jit
def sequence_span(cu_seqlens, state_indices, i_n, T, IS_VARLEN: tl.constexpr, USE_STATE_INDICES: tl.constexpr):
    """(bos, eos, slot) of sequence i_n: its first and one-past-last packed token (int64; with IS_VARLEN from
    cu_seqlens, else rows of T tokens) and its state slot (int64: state_indices[i_n], or i_n itself)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T
    slot = tl.load(state_indices + i_n).to(tl.int64) if USE_STATE_INDICES else i_n.to(tl.int64)
    return bos, eos, slot


@triton.jit
def chunk_span(cu_seqlens, chunk_indices, i_c, BT: tl.constexpr):
    """(t0, T) of chunk i_c: its first packed token (int64) and its number of valid rows (int32, <= BT)."""
    i_n, i_t = tl.load(chunk_indices + 2 * i_c), tl.load(chunk_indices + 2 * i_c + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    return t0, tl.minimum(eos - t0, BT).to(tl.int32)
