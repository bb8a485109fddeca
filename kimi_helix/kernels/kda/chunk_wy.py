"""WY stage of the Triton KDA prefill: the chunk-wide products of the inverse that the intra kernels leave in Ai.

Per chunk and head, with ``Ai = (I + A)^-1`` (fp32 scratch) and k, q L2-normalised by the intra kernels' norms::

    w  = Ai (beta exp(G) k)        u  = Ai (beta v)
    kg = exp(G_last - G) k         qg = scale exp(G) q

computed in column slices of ``BS`` so that only ``[BT, BS]`` tiles and the ``[BT, BT]`` inverse are live, by one
program per chunk or one per slice. The dots take their operands in the input dtype (fp32 accumulation), as fla's
``recompute_w_u`` does, instead of fp32 operands at tf32: 488 -> 458 us on an H200 at T=8192, H=64 (run 9).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.kda.chunk_intra import _chunk_span, _row, _store_tile, _tile


@triton.jit
def _wy_k_slice(q, k, G, b_Ai, b_b, rq, rk, w, kg, qg, c, T, scale, H: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, BS: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Columns c .. c+BS of w, kg and qg."""
    HK = H * K
    b_g = _tile(G, 0, c, T, K, HK, BT, BS)
    b_eg = tl.exp2(b_g)
    b_k = _tile(k, 0, c, T, K, HK, BT, BS) * rk[:, None]
    _store_tile(qg, _tile(q, 0, c, T, K, HK, BT, BS) * (rq * scale)[:, None] * b_eg, 0, c, T, K, HK, BT, BS)
    _store_tile(kg, b_k * tl.exp2(_row(G, T - 1, c, HK, K, BS)[None, :] - b_g), 0, c, T, K, HK, BT, BS)
    b_kb = (b_k * b_eg * b_b[:, None]).to(b_Ai.dtype)
    _store_tile(w, tl.dot(b_Ai, b_kb, input_precision=DOT_PREC), 0, c, T, K, HK, BT, BS)


@triton.jit
def _wy_v_slice(v, b_Ai, b_b, u, c, T, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                DOT_PREC: tl.constexpr):  # fmt: skip
    """Columns c .. c+BS of u."""
    b_vb = (_tile(v, 0, c, T, V, H * V, BT, BS) * b_b[:, None]).to(b_Ai.dtype)
    b_u = tl.dot(b_Ai, b_vb, input_precision=DOT_PREC)
    _store_tile(u, b_u, 0, c, T, V, H * V, BT, BS)


@triton.jit
def kda_chunk_wy_kernel(
    q,
    k,
    v,
    G,
    beta,
    Ai,
    rnorm,
    w,
    u,
    kg,
    qg,
    cu_seqlens,
    chunk_indices,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    L2NORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The WY products of one chunk and head: all column slices in one program, or with SPLIT one slice per
    program (grid axis 2: the cdiv(K, BS) slices of w, kg, qg, then the cdiv(V, BS) of u)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    # pointers start at the chunk, so offsets inside it are small
    t0, T = _chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    q += t0 * (H * K) + i_h * K
    k += t0 * (H * K) + i_h * K
    G += t0 * (H * K) + i_h * K
    w += t0 * (H * K) + i_h * K
    kg += t0 * (H * K) + i_h * K
    qg += t0 * (H * K) + i_h * K
    v += t0 * (H * V) + i_h * V
    u += t0 * (H * V) + i_h * V
    beta += t0 * H + i_h
    Ai += t0 * (H * BT) + i_h * BT
    rnorm += t0 * (2 * H) + 2 * i_h
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    m_A = m_t[:, None] & (o_t[:, None] >= o_t[None, :])
    b_Ai = tl.load(Ai + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_A, other=0.0).to(w.dtype.element_ty)
    b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    rq = tl.full([BT], 1.0, tl.float32)
    rk = tl.full([BT], 1.0, tl.float32)
    if L2NORM:  # 1/|q| and 1/|k| from the intra kernels
        rq = tl.load(rnorm + o_t * (2 * H), mask=m_t, other=1.0)
        rk = tl.load(rnorm + o_t * (2 * H) + 1, mask=m_t, other=1.0)
    if SPLIT:
        # one column slice per program: more, shorter programs in flight, each reloading the inverse from cache
        NK: tl.constexpr = (K + BS - 1) // BS
        i_s = tl.program_id(2)
        if i_s < NK:
            _wy_k_slice(q, k, G, b_Ai, b_b, rq, rk, w, kg, qg, i_s * BS, T, scale, H, K, BT, BS, DOT_PREC)
        else:
            _wy_v_slice(v, b_Ai, b_b, u, (i_s - NK) * BS, T, H, V, BT, BS, DOT_PREC)
    else:
        for c in range(0, K, BS):
            _wy_k_slice(q, k, G, b_Ai, b_b, rq, rk, w, kg, qg, c, T, scale, H, K, BT, BS, DOT_PREC)
        for c in range(0, V, BS):
            _wy_v_slice(v, b_Ai, b_b, u, c, T, H, V, BT, BS, DOT_PREC)
