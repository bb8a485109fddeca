"""WY stage of the Triton KDA prefill: the chunk-wide products of the inverse that the intra kernels leave in Ai.

Per chunk and head, with ``Ai = (I + A)^-1`` (fp32 scratch) and ``kb = beta exp(G) k`` stored by the intra kernels
(``store_decayed``, k L2-normalised)::

    w  = Ai kb        u  = Ai (beta v)

computed in column slices of ``BS`` so that only ``[BT, BS]`` tiles and the ``[BT, BT]`` inverse are live, by one
program per chunk or one per slice. The dots take their operands in the input dtype (fp32 accumulation), as fla's
``recompute_w_u`` does, instead of fp32 operands at tf32: 488 -> 458 us on an H200 at T=8192, H=64 (run 9).
Until run 15 this kernel also decayed q and k itself, reading q, k and the fp32 G from memory (415 us at that
size); the intra kernels now do it while their chunk is in L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.kda.chunk_intra import _chunk_span, _store_tile


@triton.jit
def _wy_slice(x, b_Ai, b_b, y, c, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
              SCALE_BETA: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Columns c .. c+BS of y = Ai x (x scaled by beta first with SCALE_BETA), x and y [T, D] with row stride
    H * D."""
    rows = tl.arange(0, BT)
    cols = c + tl.arange(0, BS)
    offs = rows[:, None] * (H * D) + cols[None, :]
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    b_x = tl.load(x + offs, mask=mask, other=0.0)
    if SCALE_BETA:
        b_x = (b_x.to(tl.float32) * b_b[:, None]).to(b_Ai.dtype)
    _store_tile(y, tl.dot(b_Ai, b_x.to(b_Ai.dtype), input_precision=DOT_PREC), 0, c, T, D, H * D, BT, BS)


@triton.jit
def kda_chunk_wy_kernel(
    kb,
    v,
    beta,
    Ai,
    w,
    u,
    cu_seqlens,
    chunk_indices,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """w and u of one chunk and head: all column slices in one program, or with SPLIT one slice per program (grid
    axis 2: the cdiv(K, BS) slices of w, then the cdiv(V, BS) of u)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    # pointers start at the chunk, so offsets inside it are small
    t0, T = _chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    kb += t0 * (H * K) + i_h * K
    w += t0 * (H * K) + i_h * K
    v += t0 * (H * V) + i_h * V
    u += t0 * (H * V) + i_h * V
    beta += t0 * H + i_h
    Ai += t0 * (H * BT) + i_h * BT
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    m_A = m_t[:, None] & (o_t[:, None] >= o_t[None, :])
    b_Ai = tl.load(Ai + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_A, other=0.0).to(w.dtype.element_ty)
    b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    if SPLIT:
        # one column slice per program: more, shorter programs in flight, each reloading the inverse from cache
        NK: tl.constexpr = (K + BS - 1) // BS
        i_s = tl.program_id(2)
        if i_s < NK:
            _wy_slice(kb, b_Ai, b_b, w, i_s * BS, T, H, K, BT, BS, False, DOT_PREC)
        else:
            _wy_slice(v, b_Ai, b_b, u, (i_s - NK) * BS, T, H, V, BT, BS, True, DOT_PREC)
    else:
        for c in range(0, K, BS):
            _wy_slice(kb, b_Ai, b_b, w, c, T, H, K, BT, BS, False, DOT_PREC)
        for c in range(0, V, BS):
            _wy_slice(v, b_Ai, b_b, u, c, T, H, V, BT, BS, True, DOT_PREC)
