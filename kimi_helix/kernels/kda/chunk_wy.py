"""WY stage of the Triton KDA prefill: the chunk-wide products of the inverse that the intra kernels leave in Ai.

Per chunk and head, with ``Ai = (I + A)^-1`` (fp32 scratch), ``kd = exp(G) k`` from the intra kernels
(``store_decayed``, before the L2 norm) and the row factors ``rk = 1/|k|`` they store in ``rnorm``::

    w  = rk * (Ai diag(beta rk) kd)        u  = rk * (Ai (beta v))

``w`` and ``u`` carry an extra row factor ``rk``: then ``v_new = u - w S`` in the state pass comes out scaled by it
too, which is what its update ``S += kg^T v_new`` needs with the unnormalised ``kg`` (the intra kernels leave the
same factor out of ``A_qk``'s columns for the output). The column factor goes into the inverse, in fp32, before
the inverse is rounded to the input dtype; the row factor multiplies the fp32 dot results; so no stored value is
rounded twice. Computed in column slices of ``BS`` so that only ``[BT, BS]`` tiles and the ``[BT, BT]`` inverse
are live, by one program per chunk or one per slice. The dots take their operands in the input dtype (fp32
accumulation), as fla's ``recompute_w_u`` does: faster than fp32 operands at tf32 (docs/benchmark-history.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.kda.chunk_intra import load_beta, store_tile
from kimi_helix.kernels.sequences import chunk_span


@triton.jit
def _wy_slice(x, b_A, b_b, rk, y, c, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
              SCALE_BETA: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Columns c .. c+BS of y = rk * (b_A x), x (scaled by beta first with SCALE_BETA) and y [T, D] with row stride
    H * D."""
    rows = tl.arange(0, BT)
    cols = c + tl.arange(0, BS)
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    b_x = tl.load(x + rows[:, None] * (H * D) + cols[None, :], mask=mask, other=0.0)
    if SCALE_BETA:
        b_x = b_x.to(tl.float32) * b_b[:, None]
    b_y = tl.dot(b_A, b_x.to(b_A.dtype), input_precision=DOT_PRECISION) * rk[:, None]
    store_tile(y, b_y, 0, c, T, D, H * D, BT, BS)


@triton.jit
def kda_chunk_wy_kernel(kd, v, beta, Ai, rnorm, w, u, cu_seqlens, chunk_indices, stride_bt, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, BETA_LOGITS: tl.constexpr):  # fmt: skip
    """w and u of one chunk and head: all column slices in one program, or with SPLIT one slice per program (grid
    axis 2: the cdiv(K, BS) slices of w, then the cdiv(V, BS) of u)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    # pointers start at the chunk, so offsets inside it are small
    t0, T = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    kd += t0 * (H * K) + i_h * K
    w += t0 * (H * K) + i_h * K
    v += t0 * (H * V) + i_h * V
    u += t0 * (H * V) + i_h * V
    beta += t0 * stride_bt + i_h
    Ai += t0 * (H * BT) + i_h * BT
    rnorm += t0 * (2 * H) + 2 * i_h
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    m_A = m_t[:, None] & (o_t[:, None] >= o_t[None, :])
    b_Ai = tl.load(Ai + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_A, other=0.0)
    b_b = load_beta(beta, o_t, m_t, stride_bt, BETA_LOGITS)
    rk = tl.load(rnorm + o_t * (2 * H) + 1, mask=m_t, other=0.0)
    b_Aw = (b_Ai * (b_b * rk)[None, :]).to(w.dtype.element_ty)
    b_Au = b_Ai.to(w.dtype.element_ty)
    if SPLIT:
        # one column slice per program: more, shorter programs in flight, each reloading the inverse from cache
        NK: tl.constexpr = (K + BS - 1) // BS
        i_s = tl.program_id(2)
        if i_s < NK:
            _wy_slice(kd, b_Aw, b_b, rk, w, i_s * BS, T, H, K, BT, BS, False, DOT_PRECISION)
        else:
            _wy_slice(v, b_Au, b_b, rk, u, (i_s - NK) * BS, T, H, V, BT, BS, True, DOT_PRECISION)
    else:
        for c in range(0, K, BS):
            _wy_slice(kd, b_Aw, b_b, rk, w, c, T, H, K, BT, BS, False, DOT_PRECISION)
        for c in range(0, V, BS):
            _wy_slice(v, b_Au, b_b, rk, u, c, T, H, V, BT, BS, True, DOT_PRECISION)
