"""WY stage of the Triton KDA prefill: the chunk-wide products of the inverse that the intra kernels leave in Ai.

Per chunk and head, with ``Ai = (I + A)^-1`` (fp32 scratch), k L2-normalised by the intra kernels' norms and G
recomputed from g (chunk_intra._gate_cumsum)::

    w  = Ai (beta exp(G) k)        u  = Ai (beta v)
    kg = exp(G_last - G) k         g_last = G_last (per chunk, for the state kernel)

computed in column slices of ``BS`` so that only ``[BT, BS]`` tiles and the ``[BT, BT]`` inverse are live, by one
program per chunk or one per slice.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.kda.chunk_intra import _chunk_span, _gate_cumsum, _pick_row, _store_tile, _tile


@triton.jit
def _wy_k_slice(k, g, A_log, dt_bias, lower_bound, b_Ai, b_b, rk, w, kg, g_last, i_h, c, T, H: tl.constexpr,
                K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, DOT_PREC: tl.constexpr, GATE: tl.constexpr,
                LOWER_BOUND: tl.constexpr):  # fmt: skip
    """Columns c .. c+BS of w, kg and g_last."""
    HK = H * K
    b_g = _gate_cumsum(g, A_log, dt_bias, lower_bound, i_h, c, T, H, K, BT, BS, GATE, LOWER_BOUND)
    b_last = _pick_row(b_g, T - 1, BT)
    cols = c + tl.arange(0, BS)
    tl.store(g_last + cols, b_last, mask=cols < K)
    b_k = _tile(k, 0, c, T, K, HK, BT, BS) * rk[:, None]
    _store_tile(kg, b_k * tl.exp2(b_last[None, :] - b_g), 0, c, T, K, HK, BT, BS)
    b_kb = b_k * tl.exp2(b_g) * b_b[:, None]
    _store_tile(w, tl.dot(b_Ai, b_kb, input_precision=DOT_PREC), 0, c, T, K, HK, BT, BS)


@triton.jit
def _wy_v_slice(v, b_Ai, b_b, u, c, T, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                DOT_PREC: tl.constexpr):  # fmt: skip
    """Columns c .. c+BS of u."""
    b_u = tl.dot(b_Ai, _tile(v, 0, c, T, V, H * V, BT, BS) * b_b[:, None], input_precision=DOT_PREC)
    _store_tile(u, b_u, 0, c, T, V, H * V, BT, BS)


@triton.jit
def kda_chunk_wy_kernel(
    k,
    v,
    g,
    A_log,
    dt_bias,
    lower_bound,
    beta,
    Ai,
    rnorm,
    w,
    u,
    kg,
    g_last,
    cu_seqlens,
    chunk_indices,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    L2NORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GATE: tl.constexpr,
    LOWER_BOUND: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The WY products of one chunk and head: all column slices in one program, or with SPLIT one slice per
    program (grid axis 2: the cdiv(K, BS) slices of w, kg, then the cdiv(V, BS) of u). g_last is [NT, H, K]."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    # pointers start at the chunk, so offsets inside it are small
    t0, T = _chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    k += t0 * (H * K) + i_h * K
    g += t0 * (H * K) + i_h * K
    w += t0 * (H * K) + i_h * K
    kg += t0 * (H * K) + i_h * K
    v += t0 * (H * V) + i_h * V
    u += t0 * (H * V) + i_h * V
    beta += t0 * H + i_h
    Ai += t0 * (H * BT) + i_h * BT
    rnorm += t0 * (2 * H) + 2 * i_h
    g_last += (i_c.to(tl.int64) * H + i_h) * K
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    m_A = m_t[:, None] & (o_t[:, None] >= o_t[None, :])
    b_Ai = tl.load(Ai + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_A, other=0.0)
    b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    rk = tl.full([BT], 1.0, tl.float32)
    if L2NORM:  # 1/|k| from the intra kernels
        rk = tl.load(rnorm + o_t * (2 * H) + 1, mask=m_t, other=1.0)
    if SPLIT:
        # one column slice per program: more, shorter programs in flight, each reloading the inverse from cache
        NK: tl.constexpr = (K + BS - 1) // BS
        i_s = tl.program_id(2)
        if i_s < NK:
            _wy_k_slice(k, g, A_log, dt_bias, lower_bound, b_Ai, b_b, rk, w, kg, g_last, i_h, i_s * BS, T, H, K, BT,
                        BS, DOT_PREC, GATE, LOWER_BOUND)  # fmt: skip
        else:
            _wy_v_slice(v, b_Ai, b_b, u, (i_s - NK) * BS, T, H, V, BT, BS, DOT_PREC)
    else:
        for c in range(0, K, BS):
            _wy_k_slice(k, g, A_log, dt_bias, lower_bound, b_Ai, b_b, rk, w, kg, g_last, i_h, c, T, H, K, BT, BS,
                        DOT_PREC, GATE, LOWER_BOUND)  # fmt: skip
        for c in range(0, V, BS):
            _wy_v_slice(v, b_Ai, b_b, u, c, T, H, V, BT, BS, DOT_PREC)
