"""Output stage of the Triton KDA prefill: every chunk in parallel, given the state at its start.

``o = rq * (qg h_c) + Aqk v_new`` per chunk, with ``qg = exp(G) * q``, ``rq = scale/|q|`` (in rnorm) and the causal
``Aqk`` from the intra kernels, ``h_c`` and ``v_new`` from the state kernel (chunk_h.py says how 1/|k| is
distributed among them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.sequences import chunk_span


@triton.jit
def kda_chunk_output_kernel(qg, h, Aqk, rnorm, v_new, o, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):  # fmt: skip
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # pointers start at the chunk, so in-chunk offsets stay small
    t0, T = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    qg += t0 * (H * K) + i_h * K
    Aqk += t0 * (H * BT) + i_h * BT
    rnorm += t0 * (2 * H) + 2 * i_h
    v_new += t0 * (H * V) + i_h * V
    o += t0 * (H * V) + i_h * V
    # chunks are numbered in the order of chunk_indices, which is also the order the state kernel stored h in
    h += (i_c.to(tl.int64) * H + i_h) * (K * V)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < T
    m_k = o_k < K
    m_v = o_v < V

    b_qg = tl.load(qg + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_rq = tl.load(rnorm + o_t * (2 * H), mask=m_t, other=0.0)
    b_o = tl.dot(b_qg, b_h, input_precision=DOT_PRECISION) * b_rq[:, None]
    # whole rows: the intra kernels store zeros above the diagonal (rows past the sequence end stay unwritten)
    b_A = tl.load(Aqk + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
    m_tv = m_t[:, None] & m_v[None, :]
    b_v = tl.load(v_new + o_t[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)
    b_o += tl.dot(b_A, b_v, input_precision=DOT_PRECISION)
    tl.store(o + o_t[:, None] * (H * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
