"""The exact fallback of the Triton KDA intra stage: a chunk's A_qk and (I + A_kk)^-1 block pair by block pair.

For chunks whose decay spread is too wide for the chunk-wide factorisation of chunk_intra.py. Each 16-row block pair
(i, j < i) factors ``exp2(G_i - G_j) = exp2(G_i - G_n) exp2(G_n - G_j)`` around ``G_n``, the decay at the first row
of block i, so both factors are decays (<= 1) for any gate. A diagonal block factors around its middle row when the
spread inside the block allows (always, for moderate gates) and otherwise loops over its 16 columns with the exact
pairwise decay. One sweep over K loads each row block's q, k and G slice once and feeds every pair.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.kda.chunk_intra import (
    MAX_SPREAD,
    ROUTE_BLOCKS,
    at_chunk,
    load_row,
    load_tile,
    merge_row1,
    merge_row2,
    merge_row3,
    row_factors,
    store_decayed,
    store_tile,
    unit_lower_inverse,
    zero_above_diagonal,
)


@triton.jit
def _diag_exact(q, k, G, r0, m, T, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr):
    """Unscaled A_kk and A_qk of the diagonal block at r0 with the exact pairwise decay exp(G_i - G_j), column by
    column: the path for blocks whose decay spread is too wide to factor."""
    HK = H * K
    o_c = tl.arange(0, BC)
    A_kk = tl.zeros([BC, BC], dtype=tl.float32)
    A_qk = tl.zeros([BC, BC], dtype=tl.float32)
    for j in range(BC):
        # taken only for rows at or after j, where the exponent is <= 0
        keep = (o_c >= j) & m
        rj = tl.minimum(r0 + j, T - 1)
        col_kk = tl.zeros([BC], dtype=tl.float32)
        col_qk = tl.zeros([BC], dtype=tl.float32)
        for c in range(0, K, BKS):
            b_d = load_tile(G, r0, c, T, K, HK, BC, BKS) - load_row(G, rj, c, HK, K, BKS)[None, :]
            b_kj = tl.exp2(tl.where(keep[:, None], b_d, -float("inf"))) * load_row(k, rj, c, HK, K, BKS)[None, :]
            col_kk += tl.sum(load_tile(k, r0, c, T, K, HK, BC, BKS) * b_kj, axis=1)
            col_qk += tl.sum(load_tile(q, r0, c, T, K, HK, BC, BKS) * b_kj, axis=1)
        A_kk = tl.where(o_c[None, :] == j, col_kk[:, None], A_kk)
        A_qk = tl.where(o_c[None, :] == j, col_qk[:, None], A_qk)
    return A_kk, A_qk


@triton.jit
def _scale_diag(Aqk, A_kk, A_qk, r0, rq, rk, b_b, T, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Scales and masks a diagonal block's unscaled dots (rq includes the scale): stores A_qk (lower, diagonal
    included, without its column factor), returns beta * A_kk (strictly lower)."""
    o_c = tl.arange(0, BC)
    A_qk = tl.where(o_c[:, None] >= o_c[None, :], A_qk * rq[:, None], 0.0)
    store_tile(Aqk, A_qk, r0, r0, T, BT, H * BT, BC, BC)
    return tl.where(o_c[:, None] > o_c[None, :], A_kk * (rk * b_b)[:, None] * rk[None, :], 0.0)


@triton.jit
def load_slice(q, k, G, r0, c, T, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr):
    """Columns c .. c+BKS of the row block at r0: q, k and G as fp32 [BC, BKS] tiles (zero outside)."""
    HK = H * K
    return (load_tile(q, r0, c, T, K, HK, BC, BKS), load_tile(k, r0, c, T, K, HK, BC, BKS),
            load_tile(G, r0, c, T, K, HK, BC, BKS))  # fmt: skip


@triton.jit
def _decayed_rows(b_q, b_k, b_g, G, r0, c, T, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
                  BKS: tl.constexpr):  # fmt: skip
    """q and k of the row block at r0 decayed to its first row, exp(G_i - G_n) (<= 1), and that pivot row G_n."""
    b_gn = load_row(G, tl.minimum(r0, T - 1), c, H * K, K, BKS)
    m = (r0 + tl.arange(0, BC)) < T
    e = tl.exp2(tl.where(m[:, None], b_g - b_gn[None, :], -float("inf")))
    return b_q * e, b_k * e, b_gn


@triton.jit
def _pair(qg_i, kg_i, b_gn, b_kj, b_gj, A_qk, A_kk, DOT_PRECISION: tl.constexpr):
    """Adds one column slice of block pair (i, j < i): key j decayed up to block i's pivot, exp(G_n - G_j) <= 1."""
    kt = tl.trans(b_kj * tl.exp2(b_gn[None, :] - b_gj))
    return (tl.dot(qg_i, kt, A_qk, input_precision=DOT_PRECISION),
            tl.dot(kg_i, kt, A_kk, input_precision=DOT_PRECISION))  # fmt: skip


@triton.jit
def _diag(b_q, b_k, b_g, G, r0, c, T, D_qk, D_kk, spread, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
          BKS: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Adds one column slice of the diagonal block at r0, factored around its middle row, and tracks the decay
    spread that bounds both factors (beyond MAX_SPREAD the caller recomputes the block exactly)."""
    m = (r0 + tl.arange(0, BC)) < T
    b_d = b_g - load_row(G, tl.minimum(r0 + BC // 2, T - 1), c, H * K, K, BKS)[None, :]
    spread = tl.maximum(spread, tl.max(tl.max(tl.where(m[:, None], tl.abs(b_d), 0.0), axis=1), axis=0))
    e = tl.exp2(tl.where(m[:, None], b_d, -float("inf")))
    kt = tl.trans(b_k * tl.exp2(tl.where(m[:, None], -b_d, -float("inf"))))
    return (tl.dot(b_q * e, kt, D_qk, input_precision=DOT_PRECISION),
            tl.dot(b_k * e, kt, D_kk, input_precision=DOT_PRECISION), spread)  # fmt: skip


@triton.jit
def _finish_diag(q, k, G, Aqk, D_qk, D_kk, spread, r0, rq, rk, b_b, T, H: tl.constexpr, K: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr):  # fmt: skip
    """Stores the diagonal block's A_qk; returns (I + beta A_kk)^-1 of the block."""
    m = (r0 + tl.arange(0, BC)) < T
    if spread > MAX_SPREAD:
        D_kk, D_qk = _diag_exact(q, k, G, r0, m, T, H, K, BC, BKS)
    return unit_lower_inverse(_scale_diag(Aqk, D_kk, D_qk, r0, rq, rk, b_b, T, H, BT, BC), BC)


@triton.jit
def _finish_pair(Aqk, A_qk, A_kk, ri0, rj0, rq_i, rk_i, b_i, rk_j, T, H: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr):  # fmt: skip
    """Stores block pair (i, j)'s A_qk (rq_i includes the scale; no column factor); returns its beta-scaled
    A_kk."""
    store_tile(Aqk, A_qk * rq_i[:, None], ri0, rj0, T, BT, H * BT, BC, BC)
    return A_kk * (rk_i * b_i)[:, None] * rk_j[None, :]


# same signature as chunk_intra.py:kda_chunk_intra_kernel (chunk.py launches the three intra kernels alike) —
# an argument added here belongs there too
@triton.jit
def kda_chunk_intra_blocks_kernel(
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
    """A_qk and (I + A_kk)^-1 of one chunk and head (BT <= 4 * BC rows), for the chunks routed here
    (ROUTE_BLOCKS)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    if tl.load(route + i_c * H + i_h) != ROUTE_BLOCKS:
        return
    T, q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg = at_chunk(q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg, cu_seqlens,
                                                            chunk_indices, i_c, i_h, stride_bt, H, K, BT)  # fmt: skip
    S = H * BT
    r1, r2, r3 = BC, 2 * BC, 3 * BC
    Z = tl.zeros([BC, BC], dtype=tl.float32)
    z = tl.zeros([BC], dtype=tl.float32)
    D0q, D0k, D1q, D1k, D2q, D2k, D3q, D3k = Z, Z, Z, Z, Z, Z, Z, Z
    A10q, A10k, A20q, A20k, A21q, A21k, A30q, A30k, A31q, A31k, A32q, A32k = Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, Z
    sq0, sk0, sq1, sk1, sq2, sk2, sq3, sk3 = z, z, z, z, z, z, z, z
    sp0, sp1, sp2, sp3 = 0.0, 0.0, 0.0, 0.0
    for c in range(0, K, BKS):
        b_last = load_row(G, T - 1, c, H * K, K, BKS)
        q0, k0, g0 = load_slice(q, k, G, 0, c, T, H, K, BC, BKS)
        store_decayed(q0, k0, g0, b_last, qg, kd, kg, 0, c, T, K, BC, BKS, H)
        D0q, D0k, sp0 = _diag(q0, k0, g0, G, 0, c, T, D0q, D0k, sp0, H, K, BC, BKS, DOT_PRECISION)
        sq0 += tl.sum(q0 * q0, axis=1)
        sk0 += tl.sum(k0 * k0, axis=1)
        if BT > BC:
            q1, k1, g1 = load_slice(q, k, G, r1, c, T, H, K, BC, BKS)
            store_decayed(q1, k1, g1, b_last, qg, kd, kg, r1, c, T, K, BC, BKS, H)
            qr, kr, gn = _decayed_rows(q1, k1, g1, G, r1, c, T, H, K, BC, BKS)
            A10q, A10k = _pair(qr, kr, gn, k0, g0, A10q, A10k, DOT_PRECISION)
            D1q, D1k, sp1 = _diag(q1, k1, g1, G, r1, c, T, D1q, D1k, sp1, H, K, BC, BKS, DOT_PRECISION)
            sq1 += tl.sum(q1 * q1, axis=1)
            sk1 += tl.sum(k1 * k1, axis=1)
        if BT > 2 * BC:
            q2, k2, g2 = load_slice(q, k, G, r2, c, T, H, K, BC, BKS)
            store_decayed(q2, k2, g2, b_last, qg, kd, kg, r2, c, T, K, BC, BKS, H)
            qr, kr, gn = _decayed_rows(q2, k2, g2, G, r2, c, T, H, K, BC, BKS)
            A20q, A20k = _pair(qr, kr, gn, k0, g0, A20q, A20k, DOT_PRECISION)
            A21q, A21k = _pair(qr, kr, gn, k1, g1, A21q, A21k, DOT_PRECISION)
            D2q, D2k, sp2 = _diag(q2, k2, g2, G, r2, c, T, D2q, D2k, sp2, H, K, BC, BKS, DOT_PRECISION)
            sq2 += tl.sum(q2 * q2, axis=1)
            sk2 += tl.sum(k2 * k2, axis=1)
            q3, k3, g3 = load_slice(q, k, G, r3, c, T, H, K, BC, BKS)
            store_decayed(q3, k3, g3, b_last, qg, kd, kg, r3, c, T, K, BC, BKS, H)
            qr, kr, gn = _decayed_rows(q3, k3, g3, G, r3, c, T, H, K, BC, BKS)
            A30q, A30k = _pair(qr, kr, gn, k0, g0, A30q, A30k, DOT_PRECISION)
            A31q, A31k = _pair(qr, kr, gn, k1, g1, A31q, A31k, DOT_PRECISION)
            A32q, A32k = _pair(qr, kr, gn, k2, g2, A32q, A32k, DOT_PRECISION)
            D3q, D3k, sp3 = _diag(q3, k3, g3, G, r3, c, T, D3q, D3k, sp3, H, K, BC, BKS, DOT_PRECISION)
            sq3 += tl.sum(q3 * q3, axis=1)
            sk3 += tl.sum(k3 * k3, axis=1)

    zero_above_diagonal(Aqk, T, S, BT, BC)
    rq0, rk0, b0 = row_factors(sq0, sk0, beta, rnorm, 0, T, stride_bt, scale, H, BC, USE_QK_L2NORM, BETA_LOGITS)
    Ai00 = _finish_diag(q, k, G, Aqk, D0q, D0k, sp0, 0, rq0, rk0, b0, T, H, K, BT, BC, BKS)
    store_tile(Ai, Ai00, 0, 0, T, BT, S, BC, BC)
    if BT > BC:
        rq1, rk1, b1 = row_factors(sq1, sk1, beta, rnorm, r1, T, stride_bt, scale, H, BC, USE_QK_L2NORM, BETA_LOGITS)
        Ai11 = _finish_diag(q, k, G, Aqk, D1q, D1k, sp1, r1, rq1, rk1, b1, T, H, K, BT, BC, BKS)
        A10 = _finish_pair(Aqk, A10q, A10k, r1, 0, rq1, rk1, b1, rk0, T, H, BT, BC)
        Ai10 = merge_row1(Ai00, Ai11, A10, DOT_PRECISION)
        store_tile(Ai, Ai11, r1, r1, T, BT, S, BC, BC)
        store_tile(Ai, Ai10, r1, 0, T, BT, S, BC, BC)
    if BT > 2 * BC:
        rq2, rk2, b2 = row_factors(sq2, sk2, beta, rnorm, r2, T, stride_bt, scale, H, BC, USE_QK_L2NORM, BETA_LOGITS)
        Ai22 = _finish_diag(q, k, G, Aqk, D2q, D2k, sp2, r2, rq2, rk2, b2, T, H, K, BT, BC, BKS)
        A20 = _finish_pair(Aqk, A20q, A20k, r2, 0, rq2, rk2, b2, rk0, T, H, BT, BC)
        A21 = _finish_pair(Aqk, A21q, A21k, r2, r1, rq2, rk2, b2, rk1, T, H, BT, BC)
        Ai20, Ai21 = merge_row2(Ai00, Ai11, Ai10, Ai22, A20, A21, DOT_PRECISION)
        store_tile(Ai, Ai22, r2, r2, T, BT, S, BC, BC)
        store_tile(Ai, Ai21, r2, r1, T, BT, S, BC, BC)
        store_tile(Ai, Ai20, r2, 0, T, BT, S, BC, BC)

        rq3, rk3, b3 = row_factors(sq3, sk3, beta, rnorm, r3, T, stride_bt, scale, H, BC, USE_QK_L2NORM, BETA_LOGITS)
        Ai33 = _finish_diag(q, k, G, Aqk, D3q, D3k, sp3, r3, rq3, rk3, b3, T, H, K, BT, BC, BKS)
        A30 = _finish_pair(Aqk, A30q, A30k, r3, 0, rq3, rk3, b3, rk0, T, H, BT, BC)
        A31 = _finish_pair(Aqk, A31q, A31k, r3, r1, rq3, rk3, b3, rk1, T, H, BT, BC)
        A32 = _finish_pair(Aqk, A32q, A32k, r3, r2, rq3, rk3, b3, rk2, T, H, BT, BC)
        Ai30, Ai31, Ai32 = merge_row3(Ai00, Ai11, Ai22, Ai10, Ai20, Ai21, Ai33, A30, A31, A32, DOT_PRECISION)
        store_tile(Ai, Ai33, r3, r3, T, BT, S, BC, BC)
        store_tile(Ai, Ai32, r3, r2, T, BT, S, BC, BC)
        store_tile(Ai, Ai31, r3, r1, T, BT, S, BC, BC)
        store_tile(Ai, Ai30, r3, 0, T, BT, S, BC, BC)
