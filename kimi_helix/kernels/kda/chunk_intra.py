"""Chunk-local stages of the Triton KDA prefill: the gate with the cumulative decay, and the intra-chunk matrices
``A_qk`` and ``(I + A_kk)^-1``.

The kernels run over packed tokens (``cu_seqlens`` always given; a plain batch is packed by the caller). Log-decays
are kept in log2 units (``G = cumsum(g) / ln 2``) so every decay is one ``exp2``. The entries of a chunk's A need
the pairwise decay ``exp2(G_i - G_j)`` per key dimension; ``kda_chunk_intra_kernel`` factors it around a pivot c
halfway between the chunk's first and last decay, ``exp2(G_i - c) exp2(c - G_j)``, so that two ``[BT, BT]``
tensor-core dots per column slice give every entry. Both factors are bounded by the decay spread around c, which
must stay within ``MAX_SPREAD`` for a factor not to overflow. The gate kernel, which holds the chunk's whole G,
measures that spread and routes each (chunk, head) to one intra kernel: the chunk-wide one when its spread fits;
else, when enabled, the per-half one (chunk_intra_halves.py, a pivot per half chunk) when the halves' spreads fit;
else ``kda_chunk_intra_blocks_kernel`` (chunk_intra_blocks.py), exact for any gate with a pivot inside every 16-row
block. Each intra kernel returns at once on the chunks routed elsewhere.

``(I + A_kk)^-1`` comes from the 16x16 diagonal blocks, inverted as products of powers, and block products below
them, in place in an fp32 scratch that the WY kernel (chunk_wy.py) reads. From the q, k and G tiles they load anyway,
the intra kernels also store q and k decayed from the chunk start and k decayed to its end (``store_decayed``),
before the L2 norms: their row factors go to ``rnorm`` and are applied downstream, to fp32 dot results or to the
inverse, so no stored value is rounded twice.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.kda.jit import log_decay
from kimi_helix.kernels.sequences import chunk_span

LOG2E = tl.constexpr(1.4426950408889634)
MAX_SPREAD = tl.constexpr(96.0)
# the intra kernel a (chunk, head) is routed to, in route [NT, H] int32
ROUTE_WIDE = tl.constexpr(0)
ROUTE_HALVES = tl.constexpr(1)
ROUTE_BLOCKS = tl.constexpr(2)


@triton.jit
def at_chunk(q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg, cu_seqlens, chunk_indices, i_c, i_h, stride_bt,
             H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):  # fmt: skip
    """The valid rows T of chunk i_c, and the intra kernels' pointers moved to its first token and to head i_h, so
    row indices are chunk-relative and offsets small: (T, q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg). beta's rows
    are stride_bt apart (a column slice of the projections), the others' dense."""
    t0, T = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    HK = H * K
    return (T, q + t0 * HK + i_h * K, k + t0 * HK + i_h * K, G + t0 * HK + i_h * K, beta + t0 * stride_bt + i_h,
            Aqk + t0 * (H * BT) + i_h * BT, Ai + t0 * (H * BT) + i_h * BT, rnorm + t0 * (2 * H) + 2 * i_h,
            qg + t0 * HK + i_h * K, kd + t0 * HK + i_h * K, kg + t0 * HK + i_h * K)  # fmt: skip


@triton.jit
def store_decayed(b_q, b_k, b_g, b_last, qg, kd, kg, r0, c, T, K: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr,
                  H: tl.constexpr):  # fmt: skip
    """Rows r0 .. r0+BR, columns c .. c+BS of a chunk's decayed q and k, from fp32 tiles of q, k and G that a
    kernel has loaded (b_last: G's last row in the chunk, [BS])::

        qg = exp2(G) q        kd = exp2(G) k        kg = exp2(G_last - G) k

    without the L2 norms. Stored here, from registers, the WY kernel reads kd alone (fla's split) where it read q,
    k and the fp32 G to make all three: the WY kernel saves more than the intra kernel pays. Stored by a second pass
    over the chunk after the inverse, as the exact products, they cost the intra kernels more than WY saved."""
    b_eg = tl.exp2(b_g)
    store_tile(qg, b_q * b_eg, r0, c, T, K, H * K, BR, BS)
    store_tile(kd, b_k * b_eg, r0, c, T, K, H * K, BR, BS)
    store_tile(kg, b_k * tl.exp2(b_last[None, :] - b_g), r0, c, T, K, H * K, BR, BS)


@triton.jit
def kda_chunk_gate_kernel(
    g,
    G,
    route,
    A_log,
    dt_bias,
    cu_seqlens,
    chunk_indices,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    WIDE: tl.constexpr,
    HALVES: tl.constexpr,
):
    """G of one chunk and head (optionally from the raw gate), in column slices of BK, and the intra kernel that
    takes the chunk: chunk-wide (with WIDE) or per-half (with HALVES) where their decay spread fits, else the block
    kernel."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, T = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    # pointers start at the chunk, so offsets inside it are small
    g += t0 * (H * K) + i_h * K
    G += t0 * (H * K) + i_h * K
    rate = 1.0
    if GATE_IN_KERNEL:
        rate = tl.exp(tl.load(A_log + i_h))
    spread_wide = 0.0
    spread_halves = 0.0
    for c in range(0, K, BK):
        x = load_tile(g, 0, c, T, K, H * K, BT, BK)
        if GATE_IN_KERNEL:
            o_k = c + tl.arange(0, BK)
            x = log_decay(x + tl.load(dt_bias + i_h * K + o_k, mask=o_k < K, other=0.0)[None, :], rate, lower_bound,
                          USE_LOWER_BOUND)  # fmt: skip
        # padding rows come after every valid row, so they never reach a stored cumulative sum
        b_G = tl.cumsum(x, axis=0) * LOG2E
        store_tile(G, b_G, 0, c, T, K, H * K, BT, BK)
        if WIDE or HALVES:
            tl.debug_barrier()  # the pivot rows are read back from G, stored by other threads
            sw, sh = _spreads(G, b_G, c, T, H * K, K, BT, BK, WIDE, HALVES, GATE_IN_KERNEL)
            spread_wide = tl.maximum(spread_wide, sw)
            spread_halves = tl.maximum(spread_halves, sh)
    r = tl.zeros([], dtype=tl.int32) + ROUTE_BLOCKS
    if HALVES:
        r = tl.where(spread_halves <= MAX_SPREAD, ROUTE_HALVES, r)
    if WIDE:
        r = tl.where(spread_wide <= MAX_SPREAD, ROUTE_WIDE, r)
    tl.store(route + i_c * H + i_h, r)


@triton.jit
def _spreads(G, b_G, c, T, stride, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, WIDE: tl.constexpr,
             HALVES: tl.constexpr, MONOTONE: tl.constexpr):  # fmt: skip
    """The largest exponent the chunk-wide (with WIDE, else 0) and the per-half (with HALVES, else 0) intra kernel's
    factors would reach on columns c .. c+BK of a chunk's G, [BT, BK] in registers (T valid rows) and in memory at
    G, each with that kernel's pivots. Measured here, where G is in registers, rather than in the intra kernels,
    which would hold a running maximum beside their accumulators (and did every dot before knowing whether to keep
    them).

    MONOTONE: G is non-increasing down the rows (the gate computed in the kernel is never positive), so the pivot
    rows alone bound every exponent; a given g is checked element by element, as it may break that."""
    rows = tl.arange(0, BT)
    m_k = (c + tl.arange(0, BK)) < K
    valid = (rows < T)[:, None] & m_k[None, :]
    first, last = load_row(G, 0, c, stride, K, BK), load_row(G, T - 1, c, stride, K, BK)
    wide = 0.0
    if WIDE:
        if MONOTONE:
            wide = 0.5 * tl.max(tl.where(m_k, first - last, 0.0))
        else:
            wide = tl.max(tl.where(valid, tl.abs(b_G - (0.5 * (first + last))[None, :]), 0.0))
    halves = 0.0
    if HALVES:
        HALF: tl.constexpr = BT // 2
        # each half around its mid decay, as in kda_chunk_intra_halves_kernel, whose cross block factors around g_h
        g_h = load_row(G, tl.minimum(HALF, T - 1), c, stride, K, BK)
        g_h1 = load_row(G, tl.minimum(HALF - 1, T - 1), c, stride, K, BK)
        if MONOTONE:
            halves = 0.5 * tl.max(tl.where(m_k, tl.maximum(first - g_h1, g_h - last), 0.0))
        else:
            c0 = 0.5 * (first + g_h1)[None, :]
            c1 = 0.5 * (g_h + last)[None, :]
            d = tl.where(rows[:, None] < HALF, tl.maximum(tl.abs(b_G - c0), g_h[None, :] - b_G),
                         tl.maximum(tl.abs(b_G - c1), b_G - g_h[None, :]))  # fmt: skip
            halves = tl.max(tl.where(valid, d, 0.0))
    return wide, halves


@triton.jit
def load_beta(beta, rows, mask, stride_bt, BETA_LOGITS: tl.constexpr):
    """beta of the given rows in fp32 (0 where masked): the sigmoid of the logits with BETA_LOGITS."""
    b_b = tl.load(beta + rows * stride_bt, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, tl.sigmoid(b_b), 0.0) if BETA_LOGITS else b_b


@triton.jit
def row_factors(sq, sk, beta, rnorm, r0, T, stride_bt, scale, H: tl.constexpr, BR: tl.constexpr,
                USE_QK_L2NORM: tl.constexpr, BETA_LOGITS: tl.constexpr):  # fmt: skip
    """(scale/|q|, 1/|k|, beta) of rows r0 .. r0+BR of a chunk, from the rows' sums of squares (1/|.| = 1 without
    USE_QK_L2NORM); the first two are also stored to rnorm [T, H, 2] for the WY kernel and the state pass. beta
    is the sigmoid of the loaded logits with BETA_LOGITS."""
    rows = r0 + tl.arange(0, BR)
    m = rows < T
    b_b = load_beta(beta, rows, m, stride_bt, BETA_LOGITS)
    rq = tl.full([BR], 1.0, tl.float32) * scale
    rk = tl.full([BR], 1.0, tl.float32)
    if USE_QK_L2NORM:
        rq = (1.0 / tl.sqrt(sq + 1e-6)) * scale
        rk = 1.0 / tl.sqrt(sk + 1e-6)
    tl.store(rnorm + rows * (2 * H), rq, mask=m)
    tl.store(rnorm + rows * (2 * H) + 1, rk, mask=m)
    return rq, rk, b_b


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
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BD)
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def zero_above_diagonal(Aqk, T, S, BT: tl.constexpr, BR: tl.constexpr):
    """Zeros in the [BR, BR] blocks of a chunk's A_qk (row stride S) above its diagonal blocks, which the kernels
    that compute A_qk block by block do not produce: the state and output passes load whole rows, as a causal mask
    would split their loads into 2-byte ones that Triton cannot pipeline (chunk_h.py)."""
    Z = tl.zeros([BR, BR], dtype=tl.float32)
    for i in tl.static_range(BT // BR):
        for j in tl.static_range(i + 1, BT // BR):
            store_tile(Aqk, Z, i * BR, j * BR, T, BT, S, BR, BR)


@triton.jit
def unit_lower_inverse(A, BC: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular [BC, BC] A (BC <= 32): with N = -A nilpotent, the inverse is
    sum_n N^n = (I + N)(I + N^2)(I + N^4)..., a few fp32 dots instead of BC dependent row updates (on an H200 the
    chunk-wide intra kernel took 737 us with forward substitution, 407 us with this;
    benchmarks/results/history/ablate_kda_intra.jsonl)."""
    o_c = tl.arange(0, BC)
    P = -A
    X = tl.where(o_c[:, None] == o_c[None, :], 1.0, P)
    for s in tl.static_range(4):
        if (2 << s) < BC:
            P = tl.dot(P, P, input_precision="ieee")
            X += tl.dot(X, P, input_precision="ieee")
    return X


@triton.jit
def _neg_dot(a, b, DOT_PRECISION: tl.constexpr):
    return -tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def merge_row1(Ai00, Ai11, A10, DOT_PRECISION: tl.constexpr):
    """Block (1, 0) of (I + A)^-1 from the inverted diagonal blocks and A's block: -Ai11 A10 Ai00."""
    return _neg_dot(Ai11, tl.dot(A10, Ai00, input_precision=DOT_PRECISION), DOT_PRECISION)


@triton.jit
def merge_row2(Ai00, Ai11, Ai10, Ai22, A20, A21, DOT_PRECISION: tl.constexpr):
    """Blocks (2, 0) and (2, 1) of (I + A)^-1: -Ai22 sum_{j<=m<2} A2m Ai_mj."""
    Ai21 = _neg_dot(Ai22, tl.dot(A21, Ai11, input_precision=DOT_PRECISION), DOT_PRECISION)
    b_s = tl.dot(A20, Ai00, input_precision=DOT_PRECISION) + tl.dot(A21, Ai10, input_precision=DOT_PRECISION)
    return _neg_dot(Ai22, b_s, DOT_PRECISION), Ai21


@triton.jit
def merge_row3(Ai00, Ai11, Ai22, Ai10, Ai20, Ai21, Ai33, A30, A31, A32, DOT_PRECISION: tl.constexpr):
    """Blocks (3, 0), (3, 1) and (3, 2) of (I + A)^-1: -Ai33 sum_{j<=m<3} A3m Ai_mj."""
    Ai32 = _neg_dot(Ai33, tl.dot(A32, Ai22, input_precision=DOT_PRECISION), DOT_PRECISION)
    b_s = tl.dot(A31, Ai11, input_precision=DOT_PRECISION) + tl.dot(A32, Ai21, input_precision=DOT_PRECISION)
    Ai31 = _neg_dot(Ai33, b_s, DOT_PRECISION)
    b_s = tl.dot(A30, Ai00, input_precision=DOT_PRECISION) + tl.dot(A31, Ai10, input_precision=DOT_PRECISION)
    return _neg_dot(Ai33, b_s + tl.dot(A32, Ai20, input_precision=DOT_PRECISION), DOT_PRECISION), Ai31, Ai32


@triton.jit
def _solve_below_diagonal(Ai, T, S, BT: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Completes Ai = (I + A)^-1 of one chunk in place (row stride S): given the inverted diagonal blocks and the A
    blocks below them, each block below the diagonal becomes Ai_ij = -Ai_ii sum_{j<=m<i} A_im Ai_mj. Only blocks on
    or below the diagonal exist; the readers mask the rest."""
    if BT > BC:
        Ai00 = load_tile(Ai, 0, 0, T, BT, S, BC, BC)
        Ai11 = load_tile(Ai, BC, BC, T, BT, S, BC, BC)
        Ai10 = merge_row1(Ai00, Ai11, load_tile(Ai, BC, 0, T, BT, S, BC, BC), DOT_PRECISION)
        store_tile(Ai, Ai10, BC, 0, T, BT, S, BC, BC)
    if BT > 2 * BC:
        A20 = load_tile(Ai, 2 * BC, 0, T, BT, S, BC, BC)
        A21 = load_tile(Ai, 2 * BC, BC, T, BT, S, BC, BC)
        Ai22 = load_tile(Ai, 2 * BC, 2 * BC, T, BT, S, BC, BC)
        Ai20, Ai21 = merge_row2(Ai00, Ai11, Ai10, Ai22, A20, A21, DOT_PRECISION)
        store_tile(Ai, Ai21, 2 * BC, BC, T, BT, S, BC, BC)
        store_tile(Ai, Ai20, 2 * BC, 0, T, BT, S, BC, BC)

        A30 = load_tile(Ai, 3 * BC, 0, T, BT, S, BC, BC)
        A31 = load_tile(Ai, 3 * BC, BC, T, BT, S, BC, BC)
        A32 = load_tile(Ai, 3 * BC, 2 * BC, T, BT, S, BC, BC)
        Ai33 = load_tile(Ai, 3 * BC, 3 * BC, T, BT, S, BC, BC)
        Ai30, Ai31, Ai32 = merge_row3(Ai00, Ai11, Ai22, Ai10, Ai20, Ai21, Ai33, A30, A31, A32, DOT_PRECISION)
        store_tile(Ai, Ai32, 3 * BC, 2 * BC, T, BT, S, BC, BC)
        store_tile(Ai, Ai31, 3 * BC, BC, T, BT, S, BC, BC)
        store_tile(Ai, Ai30, 3 * BC, 0, T, BT, S, BC, BC)


@triton.jit
def invert_in_place(Ai, T, S, BT: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Turns the strictly lower beta-scaled A_kk this program just stored in Ai (row stride S) into (I + A)^-1:
    the diagonal blocks inverted, then the blocks below them."""
    # The blocks are read back, and rewritten, by other threads of this program.
    tl.debug_barrier()
    for i in tl.static_range(BT // BC):
        A_ii = load_tile(Ai, i * BC, i * BC, T, BT, S, BC, BC)
        tl.debug_barrier()
        store_tile(Ai, unit_lower_inverse(A_ii, BC), i * BC, i * BC, T, BT, S, BC, BC)
    tl.debug_barrier()
    _solve_below_diagonal(Ai, T, S, BT, BC, DOT_PRECISION)


# same signature as chunk_intra_blocks.py:kda_chunk_intra_blocks_kernel and chunk_intra_halves.py:
# kda_chunk_intra_halves_kernel on purpose (the gate kernel's route gives each chunk to one of them, and chunk.py
# launches the three alike) — an argument added here belongs there too
@triton.jit
def kda_chunk_intra_kernel(
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
    """A_qk (without its 1/|k_j| column factor) and (I + A_kk)^-1 of one chunk and head, factored around the
    chunk's mid decay, with the norms and beta applied to the dot results; the decayed q and k; for the chunks
    routed here (ROUTE_WIDE)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    if tl.load(route + i_c * H + i_h) != ROUTE_WIDE:
        return
    T, q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg = at_chunk(q, k, G, beta, Aqk, Ai, rnorm, qg, kd, kg, cu_seqlens,
                                                            chunk_indices, i_c, i_h, stride_bt, H, K, BT)  # fmt: skip
    HK = H * K
    S = H * BT
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    A_qk = tl.zeros([BT, BT], dtype=tl.float32)
    A_kk = tl.zeros([BT, BT], dtype=tl.float32)
    sq = tl.zeros([BT], dtype=tl.float32)
    sk = tl.zeros([BT], dtype=tl.float32)
    for c in range(0, K, BKS):
        b_q = load_tile(q, 0, c, T, K, HK, BT, BKS)
        b_k = load_tile(k, 0, c, T, K, HK, BT, BKS)
        b_g = load_tile(G, 0, c, T, K, HK, BT, BKS)
        b_last = load_row(G, T - 1, c, HK, K, BKS)
        # a pivot halfway between the first and last decay of its rows halves the spread of a monotone G
        b_d = b_g - (0.5 * (load_row(G, 0, c, HK, K, BKS) + b_last))[None, :]
        # entries above the diagonal may overflow here; `where` discards them below
        e = tl.exp2(tl.where(m_t[:, None], b_d, -float("inf")))
        kt = tl.trans(b_k * tl.exp2(tl.where(m_t[:, None], -b_d, -float("inf"))))
        A_qk = tl.dot(b_q * e, kt, A_qk, input_precision=DOT_PRECISION)
        A_kk = tl.dot(b_k * e, kt, A_kk, input_precision=DOT_PRECISION)
        store_decayed(b_q, b_k, b_g, b_last, qg, kd, kg, 0, c, T, K, BT, BKS, H)
        sq += tl.sum(b_q * b_q, axis=1)
        sk += tl.sum(b_k * b_k, axis=1)
    rq, rk, b_b = row_factors(sq, sk, beta, rnorm, 0, T, stride_bt, scale, H, BT, USE_QK_L2NORM, BETA_LOGITS)
    offs = o_t[:, None] * S + o_t[None, :]
    A_qk = tl.where(o_t[:, None] >= o_t[None, :], A_qk * rq[:, None], 0.0)
    A_kk = tl.where(o_t[:, None] > o_t[None, :], A_kk * (rk * b_b)[:, None] * rk[None, :], 0.0)
    tl.store(Aqk + offs, A_qk.to(Aqk.dtype.element_ty), mask=m_t[:, None])
    tl.store(Ai + offs, A_kk, mask=m_t[:, None])
    invert_in_place(Ai, T, S, BT, BC, DOT_PRECISION)
