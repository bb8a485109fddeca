"""The per-half pass of the Triton KDA intra stage: a chunk's A_qk and (I + A_kk)^-1 from three half-chunk blocks.

For chunks whose decay spread is too wide for one pivot per chunk (chunk_intra.py) but fits one per half: each
half's diagonal block factors ``exp2(G_i - G_j)`` around its own mid decay, and the second half's rows against the
first half's columns around the decay at the boundary row, ``exp2(G_i - G_h) exp2(G_h - G_j)``, where both factors
are decays for a monotone G. Only the three blocks that exist are accumulated, ``[BT/2, BT/2]`` each, so six of them
(q and k dots) hold fewer registers than the chunk-wide kernel's two ``[BT, BT]``. The gate kernel routes a chunk
here when these factors stay within MAX_SPREAD (chunk_intra.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.kda.chunk_intra import (
    ROUTE_HALVES,
    at_chunk,
    invert_in_place,
    load_row,
    row_factors,
    store_decayed,
    store_tile,
    zero_above_diagonal,
)
from kimi_helix.kernels.kda.chunk_intra_blocks import load_slice


@triton.jit
def _factors(b_d, m, b_k):
    """The row factors exp2(d) of a half block and its transposed column factor (k exp2(-d))^T, masked rows
    zero."""
    return (tl.exp2(tl.where(m[:, None], b_d, -float("inf"))),
            tl.trans(b_k * tl.exp2(tl.where(m[:, None], -b_d, -float("inf")))))  # fmt: skip


# same signature as chunk_intra.py:kda_chunk_intra_kernel (chunk.py launches the three intra kernels alike) —
# an argument added here belongs there too
@triton.jit
def kda_chunk_intra_halves_kernel(
    q,
    k,
    G,
    beta,
    Aqk,
    Ai,
    rnorm,
    qg,
    kd,
    kg,
    route,
    cu_seqlens,
    chunk_indices,
    scale,
    stride_bt,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BKS: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BETA_LOGITS: tl.constexpr,
):
    """A_qk (without its 1/|k_j| column factor), (I + A_kk)^-1 and the decayed q and k of one chunk and head
    (BT >= 32), for the chunks routed here (ROUTE_HALVES)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    if tl.load(route + i_c * H + i_h) != ROUTE_HALVES:
        return
    T, q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg = at_chunk(q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg, cu_seqlens,
                                                            chunk_indices, i_c, i_h, stride_bt, H, K, BT)  # fmt: skip
    HK = H * K
    HALF: tl.constexpr = BT // 2
    o_h = tl.arange(0, HALF)
    m0 = o_h < T
    m1 = HALF + o_h < T
    Z = tl.zeros([HALF, HALF], dtype=tl.float32)
    A00q, A00k, A11q, A11k, X10q, X10k = Z, Z, Z, Z, Z, Z
    z = tl.zeros([HALF], dtype=tl.float32)
    sq0, sk0, sq1, sk1 = z, z, z, z
    for c in range(0, K, BKS):
        q0, k0, g0 = load_slice(q, k, G, 0, c, T, H, K, HALF, BKS)
        q1, k1, g1 = load_slice(q, k, G, HALF, c, T, H, K, HALF, BKS)
        g_h = load_row(G, tl.minimum(HALF, T - 1), c, HK, K, BKS)  # the decay at the boundary row
        b_last = load_row(G, T - 1, c, HK, K, BKS)
        store_decayed(q0, k0, g0, b_last, qg, kd, kg, 0, c, T, K, HALF, BKS, H)
        store_decayed(q1, k1, g1, b_last, qg, kd, kg, HALF, c, T, K, HALF, BKS, H)
        # each half's pivot halfway between its first and last decay
        g_first, g_last = load_row(G, 0, c, HK, K, BKS), load_row(G, tl.minimum(HALF - 1, T - 1), c, HK, K, BKS)
        d0 = g0 - (0.5 * (g_first + g_last))[None, :]
        d1 = g1 - (0.5 * (g_h + b_last))[None, :]
        # the cross block's factors exp2(g1 - g_h) and exp2(g_h - g0) exceed 1 only for a non-monotone G
        x1 = g1 - g_h[None, :]
        x0 = g_h[None, :] - g0
        # entries above the diagonal may overflow here; `where` discards them below
        e0, kt0 = _factors(d0, m0, k0)
        A00q = tl.dot(q0 * e0, kt0, A00q, input_precision=DOT_PRECISION)
        A00k = tl.dot(k0 * e0, kt0, A00k, input_precision=DOT_PRECISION)
        e1, kt1 = _factors(d1, m1, k1)
        A11q = tl.dot(q1 * e1, kt1, A11q, input_precision=DOT_PRECISION)
        A11k = tl.dot(k1 * e1, kt1, A11k, input_precision=DOT_PRECISION)
        ex = tl.exp2(tl.where(m1[:, None], x1, -float("inf")))
        ktx = tl.trans(k0 * tl.exp2(tl.where(m0[:, None], x0, -float("inf"))))
        X10q = tl.dot(q1 * ex, ktx, X10q, input_precision=DOT_PRECISION)
        X10k = tl.dot(k1 * ex, ktx, X10k, input_precision=DOT_PRECISION)
        sq0 += tl.sum(q0 * q0, axis=1)
        sk0 += tl.sum(k0 * k0, axis=1)
        sq1 += tl.sum(q1 * q1, axis=1)
        sk1 += tl.sum(k1 * k1, axis=1)
    rq0, rk0, b0 = row_factors(sq0, sk0, beta, rnorm, 0, T, stride_bt, scale, H, HALF, USE_QK_L2NORM, BETA_LOGITS)
    rq1, rk1, b1 = row_factors(sq1, sk1, beta, rnorm, HALF, T, stride_bt, scale, H, HALF, USE_QK_L2NORM, BETA_LOGITS)
    on, below = o_h[:, None] >= o_h[None, :], o_h[:, None] > o_h[None, :]
    S = H * BT
    A00q = tl.where(on, A00q * rq0[:, None], 0.0)
    A11q = tl.where(on, A11q * rq1[:, None], 0.0)
    store_tile(Aqk, A00q, 0, 0, T, BT, S, HALF, HALF)
    store_tile(Aqk, X10q * rq1[:, None], HALF, 0, T, BT, S, HALF, HALF)
    store_tile(Aqk, A11q, HALF, HALF, T, BT, S, HALF, HALF)
    zero_above_diagonal(Aqk, T, S, BT, HALF)
    store_tile(Ai, tl.where(below, A00k * (rk0 * b0)[:, None] * rk0[None, :], 0.0), 0, 0, T, BT, S, HALF, HALF)
    store_tile(Ai, X10k * (rk1 * b1)[:, None] * rk0[None, :], HALF, 0, T, BT, S, HALF, HALF)
    A11k = tl.where(below, A11k * (rk1 * b1)[:, None] * rk1[None, :], 0.0)
    store_tile(Ai, A11k, HALF, HALF, T, BT, S, HALF, HALF)
    invert_in_place(Ai, T, S, BT, BC, DOT_PRECISION)
