"""Chunk-local stages of the Triton KDA prefill: gate + cumulative decay, the intra-chunk A blocks, and the solve
that turns them into ``(I + A)^-1``.

The kernels run over packed tokens (``cu_seqlens`` always given; a plain batch is packed by the caller). Log-decays
are kept in log2 units (``G = cumsum(g) / ln 2``) so every decay is one ``exp2``. A chunk of ``BT`` tokens is handled
as ``NC = BT / 16`` blocks of ``BC = 16`` rows, one intra program per row block:

* off-diagonal blocks (rows i after columns j) factor ``exp(G_i - G_j) = exp(G_i - G_n) exp(G_n - G_j)`` around
  ``G_n``, the decay at the first row of block i, so both exponents are <= 0 and a tensor-core dot does the sum;
* diagonal blocks factor around their middle row when the decay spread inside the block is small enough for both
  factors to stay finite (always, for moderate gates), else loop over their 16 columns with the exact pairwise
  ``exp(G_i - G_j)``; the test is made at run time per block, so any gate is safe;
* the inverse of each 16x16 diagonal block comes by forward substitution in the intra program; the solve kernel
  then merges the blocks below the diagonal, in place in an fp32 scratch that the WY kernel (chunk_wy.py) reads.

The 16x16 dots run over K in slices of ``BKS`` columns, which keeps their replicated operands small in registers;
the L2 norms of q and k are per-row scalars applied to the dot results.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
MAX_SPREAD = tl.constexpr(96.0)


@triton.jit
def _chunk_span(cu_seqlens, chunk_indices, i_c, BT: tl.constexpr):
    """(t0, T) of chunk i_c: its first packed token (int64) and its number of valid rows (int32, <= BT)."""
    i_n, i_t = tl.load(chunk_indices + 2 * i_c), tl.load(chunk_indices + 2 * i_c + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    return t0, tl.minimum(eos - t0, BT).to(tl.int32)


@triton.jit
def kda_chunk_gate_kernel(
    g,
    G,
    A_log,
    dt_bias,
    cu_seqlens,
    chunk_indices,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATE: tl.constexpr,
    LOWER_BOUND: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, T = _chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    # pointers start at the chunk, so offsets inside it are small
    base = t0 * (H * K) + i_h * K
    x = _tile(g + base, 0, 0, T, K, H * K, BT, BK)
    if GATE:
        o_k = tl.arange(0, BK)
        x = x + tl.load(dt_bias + i_h * K + o_k, mask=o_k < K, other=0.0)[None, :]
        rate = tl.exp(tl.load(A_log + i_h))
        if LOWER_BOUND:
            x = lower_bound * tl.sigmoid(rate * x)
        else:
            # softplus with torch's threshold 20
            x = -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    # padding rows come after every valid row, so they never reach a stored cumulative sum
    _store_tile(G + base, tl.cumsum(x, axis=0) * LOG2E, 0, 0, T, K, H * K, BT, BK)


@triton.jit
def _tile(ptr, r0, c0, T, D: tl.constexpr, stride, BR: tl.constexpr, BD: tl.constexpr):
    """[BR, BD] fp32 tile at (r0, c0) of a row-major [T, D] view with row stride `stride`; zero outside."""
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BD)
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _row(ptr, r, c0, stride, D: tl.constexpr, BD: tl.constexpr):
    """Columns c0 .. c0+BD of row r (which must exist) as fp32, zero past column D."""
    cols = c0 + tl.arange(0, BD)
    return tl.load(ptr + r * stride + cols, mask=cols < D, other=0.0).to(tl.float32)


@triton.jit
def _store_tile(ptr, x, r0, c0, T, D: tl.constexpr, stride, BR: tl.constexpr, BD: tl.constexpr):
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BD)
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_norms(q, k, r0, T, H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr,
               L2NORM: tl.constexpr):  # fmt: skip
    """1/|q| and 1/|k| (fla's eps inside the root) of rows r0 .. r0+BR, or ones without the L2 norm."""
    rq = tl.full([BR], 1.0, dtype=tl.float32)
    rk = tl.full([BR], 1.0, dtype=tl.float32)
    if L2NORM:
        sq = tl.zeros([BR], dtype=tl.float32)
        sk = tl.zeros([BR], dtype=tl.float32)
        for c in range(0, K, BS):
            b_q = _tile(q, r0, c, T, K, H * K, BR, BS)
            b_k = _tile(k, r0, c, T, K, H * K, BR, BS)
            sq += tl.sum(b_q * b_q, axis=1)
            sk += tl.sum(b_k * b_k, axis=1)
        rq = 1.0 / tl.sqrt(sq + 1e-6)
        rk = 1.0 / tl.sqrt(sk + 1e-6)
    return rq, rk


@triton.jit
def _block_rows(q, k, beta, r0, T, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
                L2NORM: tl.constexpr):  # fmt: skip
    """Per-row data of the block at r0: valid mask, 1/|q|, 1/|k| and beta."""
    rows = r0 + tl.arange(0, BC)
    m = rows < T
    rq, rk = _row_norms(q, k, r0, T, H, K, BC, BKS, L2NORM)
    return m, rq, rk, tl.load(beta + rows * H, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _offdiag_block(q, k, G, Aqk, ri0, rj0, m_i, rq_i, rk_i, b_bi, rk_j, T, scale, H: tl.constexpr, K: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Row block i (at ri0) against an earlier column block j (at rj0): stores A_qk, returns beta * A_kk."""
    HK = H * K
    # The pivot is the first row of block i (the last valid row if block i is all padding): it lies between every
    # (i, j) pair, so both factors are decays and neither can overflow.
    rn = tl.minimum(ri0, T - 1)
    A_kk = tl.zeros([BC, BC], dtype=tl.float32)
    A_qk = tl.zeros([BC, BC], dtype=tl.float32)
    for c in range(0, K, BKS):
        b_gn = _row(G, rn, c, HK, K, BKS)
        e_i = tl.exp2(tl.where(m_i[:, None], _tile(G, ri0, c, T, K, HK, BC, BKS) - b_gn[None, :], -float("inf")))
        b_kt = _tile(k, rj0, c, T, K, HK, BC, BKS) * tl.exp2(b_gn[None, :] - _tile(G, rj0, c, T, K, HK, BC, BKS))
        b_kt = tl.trans(b_kt)
        A_kk += tl.dot(_tile(k, ri0, c, T, K, HK, BC, BKS) * e_i, b_kt, input_precision=DOT_PREC)
        A_qk += tl.dot(_tile(q, ri0, c, T, K, HK, BC, BKS) * e_i, b_kt, input_precision=DOT_PREC)
    _store_tile(Aqk, A_qk * (rq_i * scale)[:, None] * rk_j[None, :], ri0, rj0, T, BT, H * BT, BC, BC)
    return A_kk * (rk_i * b_bi)[:, None] * rk_j[None, :]


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
            b_d = _tile(G, r0, c, T, K, HK, BC, BKS) - _row(G, rj, c, HK, K, BKS)[None, :]
            b_kj = tl.exp2(tl.where(keep[:, None], b_d, -float("inf"))) * _row(k, rj, c, HK, K, BKS)[None, :]
            col_kk += tl.sum(_tile(k, r0, c, T, K, HK, BC, BKS) * b_kj, axis=1)
            col_qk += tl.sum(_tile(q, r0, c, T, K, HK, BC, BKS) * b_kj, axis=1)
        A_kk = tl.where(o_c[None, :] == j, col_kk[:, None], A_kk)
        A_qk = tl.where(o_c[None, :] == j, col_qk[:, None], A_qk)
    return A_kk, A_qk


@triton.jit
def _diag_finish(Aqk, A_kk, A_qk, r0, rq, rk, b_b, T, scale, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Scales and masks a diagonal block's unscaled dots: stores A_qk (lower, diagonal included), returns
    beta * A_kk (strictly lower)."""
    o_c = tl.arange(0, BC)
    A_qk = tl.where(o_c[:, None] >= o_c[None, :], A_qk * (rq * scale)[:, None] * rk[None, :], 0.0)
    _store_tile(Aqk, A_qk, r0, r0, T, BT, H * BT, BC, BC)
    return tl.where(o_c[:, None] > o_c[None, :], A_kk * (rk * b_b)[:, None] * rk[None, :], 0.0)


@triton.jit
def _diag_block(q, k, G, Aqk, r0, m, rq, rk, b_b, T, scale, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, BKS: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """One 16-row diagonal block: stores A_qk (lower, diagonal included), returns beta * A_kk (strictly lower)."""
    HK = H * K
    # Factored around the middle row, both exponents are bounded by the decay spread inside the block: when that is
    # below MAX_SPREAD (log2 units) neither factor can overflow or vanish and one dot does the block; a block with a
    # stronger decay takes the exact pairwise loop.
    rm = tl.minimum(r0 + BC // 2, T - 1)
    spread = 0.0
    for c in range(0, K, BKS):
        b_d = tl.abs(_tile(G, r0, c, T, K, HK, BC, BKS) - _row(G, rm, c, HK, K, BKS)[None, :])
        spread = tl.maximum(spread, tl.max(tl.max(tl.where(m[:, None], b_d, 0.0), axis=1), axis=0))
    A_kk = tl.zeros([BC, BC], dtype=tl.float32)
    A_qk = tl.zeros([BC, BC], dtype=tl.float32)
    if spread <= MAX_SPREAD:
        for c in range(0, K, BKS):
            b_d = _tile(G, r0, c, T, K, HK, BC, BKS) - _row(G, rm, c, HK, K, BKS)[None, :]
            b_k = _tile(k, r0, c, T, K, HK, BC, BKS)
            b_kt = tl.trans(b_k * tl.exp2(tl.where(m[:, None], -b_d, -float("inf"))))
            e = tl.exp2(tl.where(m[:, None], b_d, -float("inf")))
            A_kk += tl.dot(b_k * e, b_kt, input_precision=DOT_PREC)
            A_qk += tl.dot(_tile(q, r0, c, T, K, HK, BC, BKS) * e, b_kt, input_precision=DOT_PREC)
    else:
        A_kk, A_qk = _diag_exact(q, k, G, r0, m, T, H, K, BC, BKS)
    return _diag_finish(Aqk, A_kk, A_qk, r0, rq, rk, b_b, T, scale, H, BT, BC)


@triton.jit
def _row_sweep(q, k, G, beta, Aqk, Ai, r0, T, scale, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
               BC: tl.constexpr, BKS: tl.constexpr, L2NORM: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """The row block at r0 in one sweep over K, each slice of its q, k and G loaded once: the A blocks against
    every earlier row of the chunk at once ([BC, BT] dots around the block's first row, a decay pivot for every such
    pair), the diagonal block around its middle row (the exact loop when its spread is too wide), and the L2 norms.
    Stores what the pairwise path stores: A_qk, the beta-scaled A_kk left of the diagonal, the inverse diagonal
    block."""
    HK = H * K
    o_i = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    o_s = tl.arange(0, BKS)
    m = r0 + o_i < T
    m_prev = o_t < r0  # the earlier rows of the chunk: the columns left of the diagonal block
    rm = tl.minimum(r0 + BC // 2, T - 1)
    acc_kk = tl.zeros([BC, BT], dtype=tl.float32)
    acc_qk = tl.zeros([BC, BT], dtype=tl.float32)
    d_kk = tl.zeros([BC, BC], dtype=tl.float32)
    d_qk = tl.zeros([BC, BC], dtype=tl.float32)
    sq = tl.zeros([BC], dtype=tl.float32)
    sk = tl.zeros([BC], dtype=tl.float32)
    sk_t = tl.zeros([BT], dtype=tl.float32)
    spread = 0.0
    for c in range(0, K, BKS):
        g_i = _tile(G, r0, c, T, K, HK, BC, BKS)
        b_k = _tile(k, r0, c, T, K, HK, BC, BKS)
        b_q = _tile(q, r0, c, T, K, HK, BC, BKS)
        m_t = m_prev[:, None] & (c + o_s < K)[None, :]
        k_t = tl.load(k + o_t[:, None] * HK + c + o_s[None, :], mask=m_t, other=0.0).to(tl.float32)
        g_t = tl.load(G + o_t[:, None] * HK + c + o_s[None, :], mask=m_t, other=0.0)
        g_n = _row(G, r0, c, HK, K, BKS)
        e_n = tl.exp2(tl.where(m[:, None], g_i - g_n[None, :], -float("inf")))
        kt = tl.trans(k_t * tl.exp2(tl.where(m_prev[:, None], g_n[None, :] - g_t, -float("inf"))))
        acc_kk += tl.dot(b_k * e_n, kt, input_precision=DOT_PREC)
        acc_qk += tl.dot(b_q * e_n, kt, input_precision=DOT_PREC)
        # the diagonal block; a spread beyond MAX_SPREAD may overflow here, and is recomputed exactly below
        b_d = g_i - _row(G, rm, c, HK, K, BKS)[None, :]
        spread = tl.maximum(spread, tl.max(tl.max(tl.where(m[:, None], tl.abs(b_d), 0.0), axis=1), axis=0))
        e_m = tl.exp2(tl.where(m[:, None], b_d, -float("inf")))
        kt_m = tl.trans(b_k * tl.exp2(tl.where(m[:, None], -b_d, -float("inf"))))
        d_kk += tl.dot(b_k * e_m, kt_m, input_precision=DOT_PREC)
        d_qk += tl.dot(b_q * e_m, kt_m, input_precision=DOT_PREC)
        sq += tl.sum(b_q * b_q, axis=1)
        sk += tl.sum(b_k * b_k, axis=1)
        sk_t += tl.sum(k_t * k_t, axis=1)
    rq = tl.full([BC], 1.0, dtype=tl.float32)
    rk = tl.full([BC], 1.0, dtype=tl.float32)
    rk_t = tl.full([BT], 1.0, dtype=tl.float32)
    if L2NORM:
        rq = 1.0 / tl.sqrt(sq + 1e-6)
        rk = 1.0 / tl.sqrt(sk + 1e-6)
        rk_t = 1.0 / tl.sqrt(sk_t + 1e-6)
    b_b = tl.load(beta + (r0 + o_i) * H, mask=m, other=0.0).to(tl.float32)
    offs = (r0 + o_i)[:, None] * (H * BT) + o_t[None, :]
    m_off = m[:, None] & m_prev[None, :]
    tl.store(Aqk + offs, (acc_qk * (rq * scale)[:, None] * rk_t[None, :]).to(Aqk.dtype.element_ty), mask=m_off)
    tl.store(Ai + offs, acc_kk * (rk * b_b)[:, None] * rk_t[None, :], mask=m_off)
    if spread > MAX_SPREAD:
        d_kk, d_qk = _diag_exact(q, k, G, r0, m, T, H, K, BC, BKS)
    A_ii = _diag_finish(Aqk, d_kk, d_qk, r0, rq, rk, b_b, T, scale, H, BT, BC)
    _store_tile(Ai, _unit_lower_inverse(A_ii, BC), r0, r0, T, BT, H * BT, BC, BC)


@triton.jit
def _unit_lower_inverse(A, BC: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular [BC, BC] A, by forward substitution over rows."""
    o_c = tl.arange(0, BC)
    X = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    for r in range(1, BC):
        a_r = tl.sum(tl.where(o_c[:, None] == r, A, 0.0), axis=0)
        # rows above r are final and row r is still e_r
        X = tl.where(o_c[:, None] == r, X - tl.sum(a_r[:, None] * X, axis=0)[None, :], X)
    return X


@triton.jit
def _neg_dot(a, b, DOT_PREC: tl.constexpr):
    return -tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def kda_chunk_intra_kernel(
    q,
    k,
    G,
    beta,
    Aqk,
    Ai,
    cu_seqlens,
    chunk_indices,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BKS: tl.constexpr,
    L2NORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ROW_SWEEP: tl.constexpr,
):
    """One 16-row block i of one chunk and head: the A_qk blocks of the row (stored to Aqk), the beta-scaled A_kk
    blocks left of the diagonal (stored to the Ai scratch for the solve kernel) and the inverse of the diagonal
    block, (I + A_ii)^-1, stored in its place. One program per row block keeps few tiles live, so many programs
    share an SM."""
    i_c, i_h, i_i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # pointers start at the chunk, so row indices are chunk-relative and offsets small; T = valid rows of the chunk
    t0, T = _chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    r0 = i_i * BC
    if r0 >= T:
        return  # a block wholly past the sequence end: its readers mask it
    q += t0 * (H * K) + i_h * K
    k += t0 * (H * K) + i_h * K
    G += t0 * (H * K) + i_h * K
    beta += t0 * H + i_h
    Aqk += t0 * (H * BT) + i_h * BT
    Ai += t0 * (H * BT) + i_h * BT

    if ROW_SWEEP:
        _row_sweep(q, k, G, beta, Aqk, Ai, r0, T, scale, H, K, BT, BC, BKS, L2NORM, DOT_PREC)
    else:
        # block pair by block pair, each its own sweep over K
        m, rq, rk, b_b = _block_rows(q, k, beta, r0, T, H, K, BC, BKS, L2NORM)
        for j in range(0, i_i):
            rj0 = j * BC
            _, rk_j = _row_norms(q, k, rj0, T, H, K, BC, BKS, L2NORM)
            A_ij = _offdiag_block(q, k, G, Aqk, r0, rj0, m, rq, rk, b_b, rk_j, T, scale, H, K, BT, BC, BKS, DOT_PREC)
            _store_tile(Ai, A_ij, r0, rj0, T, BT, H * BT, BC, BC)
        A_ii = _diag_block(q, k, G, Aqk, r0, m, rq, rk, b_b, T, scale, H, K, BT, BC, BKS, DOT_PREC)
        _store_tile(Ai, _unit_lower_inverse(A_ii, BC), r0, r0, T, BT, H * BT, BC, BC)


@triton.jit
def kda_chunk_solve_kernel(
    Ai,
    cu_seqlens,
    chunk_indices,
    H: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Completes Ai = (I + A)^-1 of one chunk in place: given the inverted diagonal blocks and the A blocks below
    them, each block below the diagonal becomes Ai_ij = -Ai_ii sum_{j<=m<i} A_im Ai_mj. Only blocks on or below the
    diagonal exist; the readers mask the rest."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, T = _chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    Ai += t0 * (H * BT) + i_h * BT
    S = H * BT
    if BT > BC:
        Ai00 = _tile(Ai, 0, 0, T, BT, S, BC, BC)
        Ai11 = _tile(Ai, BC, BC, T, BT, S, BC, BC)
        Ai10 = _neg_dot(Ai11, tl.dot(_tile(Ai, BC, 0, T, BT, S, BC, BC), Ai00, input_precision=DOT_PREC), DOT_PREC)
        _store_tile(Ai, Ai10, BC, 0, T, BT, S, BC, BC)
    if BT > 2 * BC:
        A20 = _tile(Ai, 2 * BC, 0, T, BT, S, BC, BC)
        A21 = _tile(Ai, 2 * BC, BC, T, BT, S, BC, BC)
        Ai22 = _tile(Ai, 2 * BC, 2 * BC, T, BT, S, BC, BC)
        Ai21 = _neg_dot(Ai22, tl.dot(A21, Ai11, input_precision=DOT_PREC), DOT_PREC)
        b_s = tl.dot(A20, Ai00, input_precision=DOT_PREC) + tl.dot(A21, Ai10, input_precision=DOT_PREC)
        Ai20 = _neg_dot(Ai22, b_s, DOT_PREC)
        _store_tile(Ai, Ai21, 2 * BC, BC, T, BT, S, BC, BC)
        _store_tile(Ai, Ai20, 2 * BC, 0, T, BT, S, BC, BC)

        A30 = _tile(Ai, 3 * BC, 0, T, BT, S, BC, BC)
        A31 = _tile(Ai, 3 * BC, BC, T, BT, S, BC, BC)
        A32 = _tile(Ai, 3 * BC, 2 * BC, T, BT, S, BC, BC)
        Ai33 = _tile(Ai, 3 * BC, 3 * BC, T, BT, S, BC, BC)
        Ai32 = _neg_dot(Ai33, tl.dot(A32, Ai22, input_precision=DOT_PREC), DOT_PREC)
        b_s = tl.dot(A31, Ai11, input_precision=DOT_PREC) + tl.dot(A32, Ai21, input_precision=DOT_PREC)
        Ai31 = _neg_dot(Ai33, b_s, DOT_PREC)
        b_s = tl.dot(A30, Ai00, input_precision=DOT_PREC) + tl.dot(A31, Ai10, input_precision=DOT_PREC)
        Ai30 = _neg_dot(Ai33, b_s + tl.dot(A32, Ai20, input_precision=DOT_PREC), DOT_PREC)
        _store_tile(Ai, Ai32, 3 * BC, 2 * BC, T, BT, S, BC, BC)
        _store_tile(Ai, Ai31, 3 * BC, BC, T, BT, S, BC, BC)
        _store_tile(Ai, Ai30, 3 * BC, 0, T, BT, S, BC, BC)


@triton.jit
def _slice(q, k, G, r0, c, T, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr):
    """Columns c .. c+BKS of the row block at r0: q, k and G as fp32 [BC, BKS] tiles (zero outside)."""
    HK = H * K
    return (_tile(q, r0, c, T, K, HK, BC, BKS), _tile(k, r0, c, T, K, HK, BC, BKS),
            _tile(G, r0, c, T, K, HK, BC, BKS))  # fmt: skip


@triton.jit
def _decayed_rows(b_q, b_k, b_g, G, r0, c, T, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
                  BKS: tl.constexpr):  # fmt: skip
    """q and k of the row block at r0 decayed to its first row, exp(G_i - G_n) (<= 1), and that pivot row G_n."""
    b_gn = _row(G, tl.minimum(r0, T - 1), c, H * K, K, BKS)
    m = (r0 + tl.arange(0, BC)) < T
    e = tl.exp2(tl.where(m[:, None], b_g - b_gn[None, :], -float("inf")))
    return b_q * e, b_k * e, b_gn


@triton.jit
def _pair(qg_i, kg_i, b_gn, b_kj, b_gj, A_qk, A_kk, DOT_PREC: tl.constexpr):
    """Adds one column slice of block pair (i, j < i): key j decayed up to block i's pivot, exp(G_n - G_j) <= 1."""
    kt = tl.trans(b_kj * tl.exp2(b_gn[None, :] - b_gj))
    return (tl.dot(qg_i, kt, A_qk, input_precision=DOT_PREC),
            tl.dot(kg_i, kt, A_kk, input_precision=DOT_PREC))  # fmt: skip


@triton.jit
def _diag(b_q, b_k, b_g, G, r0, c, T, D_qk, D_kk, spread, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
          BKS: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Adds one column slice of the diagonal block at r0, factored around its middle row, and tracks the decay
    spread that bounds both factors (beyond MAX_SPREAD the caller recomputes the block exactly)."""
    m = (r0 + tl.arange(0, BC)) < T
    b_d = b_g - _row(G, tl.minimum(r0 + BC // 2, T - 1), c, H * K, K, BKS)[None, :]
    spread = tl.maximum(spread, tl.max(tl.max(tl.where(m[:, None], tl.abs(b_d), 0.0), axis=1), axis=0))
    e = tl.exp2(tl.where(m[:, None], b_d, -float("inf")))
    kt = tl.trans(b_k * tl.exp2(tl.where(m[:, None], -b_d, -float("inf"))))
    return (tl.dot(b_q * e, kt, D_qk, input_precision=DOT_PREC),
            tl.dot(b_k * e, kt, D_kk, input_precision=DOT_PREC), spread)  # fmt: skip


@triton.jit
def _finish_diag(q, k, G, Aqk, D_qk, D_kk, spread, r0, rq, rk, b_b, T, scale, H: tl.constexpr, K: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr):  # fmt: skip
    """Stores the diagonal block's A_qk; returns (I + beta A_kk)^-1 of the block."""
    m = (r0 + tl.arange(0, BC)) < T
    if spread > MAX_SPREAD:
        D_kk, D_qk = _diag_exact(q, k, G, r0, m, T, H, K, BC, BKS)
    return _unit_lower_inverse(_diag_finish(Aqk, D_kk, D_qk, r0, rq, rk, b_b, T, scale, H, BT, BC), BC)


@triton.jit
def _finish_pair(Aqk, A_qk, A_kk, ri0, rj0, rq_i, rk_i, b_i, rk_j, T, scale, H: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr):  # fmt: skip
    """Stores block pair (i, j)'s A_qk; returns its beta-scaled A_kk."""
    _store_tile(Aqk, A_qk * (rq_i * scale)[:, None] * rk_j[None, :], ri0, rj0, T, BT, H * BT, BC, BC)
    return A_kk * (rk_i * b_i)[:, None] * rk_j[None, :]


@triton.jit
def _norm_beta(sq, sk, beta, r0, T, H: tl.constexpr, BC: tl.constexpr, L2NORM: tl.constexpr):
    """1/|q|, 1/|k| (or ones) and beta of the row block at r0."""
    rows = r0 + tl.arange(0, BC)
    b_b = tl.load(beta + rows * H, mask=rows < T, other=0.0).to(tl.float32)
    if L2NORM:
        return 1.0 / tl.sqrt(sq + 1e-6), 1.0 / tl.sqrt(sk + 1e-6), b_b
    return tl.full([BC], 1.0, tl.float32), tl.full([BC], 1.0, tl.float32), b_b


@triton.jit
def kda_chunk_intra_solve_kernel(
    q,
    k,
    G,
    beta,
    Aqk,
    Ai,
    cu_seqlens,
    chunk_indices,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BKS: tl.constexpr,
    L2NORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """A whole chunk and head in one program: one sweep over K loads each row block's q, k and G slice once and
    feeds every block pair (i, j <= i) of the chunk, then the L2 norms and beta scale them, A_qk is stored, and
    (I + A)^-1 is built from the inverted diagonal blocks and stored to Ai. Chunks of BT <= 4 * BC rows."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, T = _chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    q += t0 * (H * K) + i_h * K
    k += t0 * (H * K) + i_h * K
    G += t0 * (H * K) + i_h * K
    beta += t0 * H + i_h
    Aqk += t0 * (H * BT) + i_h * BT
    Ai += t0 * (H * BT) + i_h * BT
    S = H * BT
    r1, r2, r3 = BC, 2 * BC, 3 * BC
    Z = tl.zeros([BC, BC], dtype=tl.float32)
    z = tl.zeros([BC], dtype=tl.float32)
    D0q, D0k, D1q, D1k, D2q, D2k, D3q, D3k = Z, Z, Z, Z, Z, Z, Z, Z
    A10q, A10k, A20q, A20k, A21q, A21k, A30q, A30k, A31q, A31k, A32q, A32k = Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, Z
    sq0, sk0, sq1, sk1, sq2, sk2, sq3, sk3 = z, z, z, z, z, z, z, z
    sp0, sp1, sp2, sp3 = 0.0, 0.0, 0.0, 0.0
    for c in range(0, K, BKS):
        q0, k0, g0 = _slice(q, k, G, 0, c, T, H, K, BC, BKS)
        D0q, D0k, sp0 = _diag(q0, k0, g0, G, 0, c, T, D0q, D0k, sp0, H, K, BC, BKS, DOT_PREC)
        sq0 += tl.sum(q0 * q0, axis=1)
        sk0 += tl.sum(k0 * k0, axis=1)
        if BT > BC:
            q1, k1, g1 = _slice(q, k, G, r1, c, T, H, K, BC, BKS)
            qg, kg, gn = _decayed_rows(q1, k1, g1, G, r1, c, T, H, K, BC, BKS)
            A10q, A10k = _pair(qg, kg, gn, k0, g0, A10q, A10k, DOT_PREC)
            D1q, D1k, sp1 = _diag(q1, k1, g1, G, r1, c, T, D1q, D1k, sp1, H, K, BC, BKS, DOT_PREC)
            sq1 += tl.sum(q1 * q1, axis=1)
            sk1 += tl.sum(k1 * k1, axis=1)
        if BT > 2 * BC:
            q2, k2, g2 = _slice(q, k, G, r2, c, T, H, K, BC, BKS)
            qg, kg, gn = _decayed_rows(q2, k2, g2, G, r2, c, T, H, K, BC, BKS)
            A20q, A20k = _pair(qg, kg, gn, k0, g0, A20q, A20k, DOT_PREC)
            A21q, A21k = _pair(qg, kg, gn, k1, g1, A21q, A21k, DOT_PREC)
            D2q, D2k, sp2 = _diag(q2, k2, g2, G, r2, c, T, D2q, D2k, sp2, H, K, BC, BKS, DOT_PREC)
            sq2 += tl.sum(q2 * q2, axis=1)
            sk2 += tl.sum(k2 * k2, axis=1)
            q3, k3, g3 = _slice(q, k, G, r3, c, T, H, K, BC, BKS)
            qg, kg, gn = _decayed_rows(q3, k3, g3, G, r3, c, T, H, K, BC, BKS)
            A30q, A30k = _pair(qg, kg, gn, k0, g0, A30q, A30k, DOT_PREC)
            A31q, A31k = _pair(qg, kg, gn, k1, g1, A31q, A31k, DOT_PREC)
            A32q, A32k = _pair(qg, kg, gn, k2, g2, A32q, A32k, DOT_PREC)
            D3q, D3k, sp3 = _diag(q3, k3, g3, G, r3, c, T, D3q, D3k, sp3, H, K, BC, BKS, DOT_PREC)
            sq3 += tl.sum(q3 * q3, axis=1)
            sk3 += tl.sum(k3 * k3, axis=1)

    rq0, rk0, b0 = _norm_beta(sq0, sk0, beta, 0, T, H, BC, L2NORM)
    Ai00 = _finish_diag(q, k, G, Aqk, D0q, D0k, sp0, 0, rq0, rk0, b0, T, scale, H, K, BT, BC, BKS)
    _store_tile(Ai, Ai00, 0, 0, T, BT, S, BC, BC)
    if BT > BC:
        rq1, rk1, b1 = _norm_beta(sq1, sk1, beta, r1, T, H, BC, L2NORM)
        Ai11 = _finish_diag(q, k, G, Aqk, D1q, D1k, sp1, r1, rq1, rk1, b1, T, scale, H, K, BT, BC, BKS)
        A10 = _finish_pair(Aqk, A10q, A10k, r1, 0, rq1, rk1, b1, rk0, T, scale, H, BT, BC)
        Ai10 = _neg_dot(Ai11, tl.dot(A10, Ai00, input_precision=DOT_PREC), DOT_PREC)
        _store_tile(Ai, Ai11, r1, r1, T, BT, S, BC, BC)
        _store_tile(Ai, Ai10, r1, 0, T, BT, S, BC, BC)
    if BT > 2 * BC:
        rq2, rk2, b2 = _norm_beta(sq2, sk2, beta, r2, T, H, BC, L2NORM)
        Ai22 = _finish_diag(q, k, G, Aqk, D2q, D2k, sp2, r2, rq2, rk2, b2, T, scale, H, K, BT, BC, BKS)
        A20 = _finish_pair(Aqk, A20q, A20k, r2, 0, rq2, rk2, b2, rk0, T, scale, H, BT, BC)
        A21 = _finish_pair(Aqk, A21q, A21k, r2, r1, rq2, rk2, b2, rk1, T, scale, H, BT, BC)
        Ai21 = _neg_dot(Ai22, tl.dot(A21, Ai11, input_precision=DOT_PREC), DOT_PREC)
        b_s = tl.dot(A20, Ai00, input_precision=DOT_PREC) + tl.dot(A21, Ai10, input_precision=DOT_PREC)
        Ai20 = _neg_dot(Ai22, b_s, DOT_PREC)
        _store_tile(Ai, Ai22, r2, r2, T, BT, S, BC, BC)
        _store_tile(Ai, Ai21, r2, r1, T, BT, S, BC, BC)
        _store_tile(Ai, Ai20, r2, 0, T, BT, S, BC, BC)

        rq3, rk3, b3 = _norm_beta(sq3, sk3, beta, r3, T, H, BC, L2NORM)
        Ai33 = _finish_diag(q, k, G, Aqk, D3q, D3k, sp3, r3, rq3, rk3, b3, T, scale, H, K, BT, BC, BKS)
        A30 = _finish_pair(Aqk, A30q, A30k, r3, 0, rq3, rk3, b3, rk0, T, scale, H, BT, BC)
        A31 = _finish_pair(Aqk, A31q, A31k, r3, r1, rq3, rk3, b3, rk1, T, scale, H, BT, BC)
        A32 = _finish_pair(Aqk, A32q, A32k, r3, r2, rq3, rk3, b3, rk2, T, scale, H, BT, BC)
        Ai32 = _neg_dot(Ai33, tl.dot(A32, Ai22, input_precision=DOT_PREC), DOT_PREC)
        b_s = tl.dot(A31, Ai11, input_precision=DOT_PREC) + tl.dot(A32, Ai21, input_precision=DOT_PREC)
        Ai31 = _neg_dot(Ai33, b_s, DOT_PREC)
        b_s = tl.dot(A30, Ai00, input_precision=DOT_PREC) + tl.dot(A31, Ai10, input_precision=DOT_PREC)
        Ai30 = _neg_dot(Ai33, b_s + tl.dot(A32, Ai20, input_precision=DOT_PREC), DOT_PREC)
        _store_tile(Ai, Ai33, r3, r3, T, BT, S, BC, BC)
        _store_tile(Ai, Ai32, r3, r2, T, BT, S, BC, BC)
        _store_tile(Ai, Ai31, r3, r1, T, BT, S, BC, BC)
        _store_tile(Ai, Ai30, r3, 0, T, BT, S, BC, BC)
