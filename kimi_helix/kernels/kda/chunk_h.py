"""Inter-chunk state recurrence of the Triton KDA prefill: the only sequential stage.

One program per (sequence, head, block of BV value columns) walks the chunks of its sequence carrying the state
``S [K, BV]`` in fp32 registers. Per chunk, with w, u, kg, qg from the WY kernel and Aqk from the intra kernels::

    v_new = u - w S
    o     = qg S + Aqk v_new                     (FUSE_OUTPUT; else S and v_new are stored for the output kernel)
    S     = exp(G_last) * S + kg^T v_new        (kg = exp(G_last - G) * k)

With FUSE_OUTPUT the output comes out of this pass, so neither the per-chunk states (K V values a chunk) nor
v_new go through memory; the extra loads (qg, Aqk) do not depend on the carried state, so they overlap it.
The initial state is read from, and the final state written back to, either a per-sequence tensor ``[N, H, K, V]``
or a slot of a state pool ``[slots, H, K, V]`` chosen by ``state_indices``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kda_chunk_state_kernel(
    w,
    u,
    kg,
    G,
    qg,
    Aqk,
    o,
    h,
    v_new,
    h0,
    ht,
    state_indices,
    cu_seqlens,
    chunk_offsets,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    FUSE_OUTPUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    w += bos * (H * K) + i_h * K
    kg += bos * (H * K) + i_h * K
    G += bos * (H * K) + i_h * K
    u += bos * (H * V) + i_h * V
    v_new += bos * (H * V) + i_h * V
    qg += bos * (H * K) + i_h * K
    Aqk += bos * (H * BT) + i_h * BT
    o += bos * (H * V) + i_h * V

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    offs_kv = o_k[:, None] * V + o_v[None, :]

    slot = i_n.to(tl.int64)
    if USE_STATE_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INITIAL_STATE:
        b_S = tl.load(h0 + (slot * H + i_h) * (K * V) + offs_kv, mask=m_kv, other=0.0).to(tl.float32)

    h += (boh * H + i_h) * (K * V)
    for i_t in range(tl.cdiv(T, BT)):
        # the per-token pointers point at the current chunk (advanced below), so in-chunk offsets stay small. The
        # tile offsets are written out at each use, not hoisted into loop-invariant tensors: held across the loop
        # those spilled (1120 bytes a thread at BV=64 with 8 warps under Triton 3.6 for sm_90; none or few this way).
        m_t = o_t < T - i_t * BT
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(w + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_Sc = b_S.to(b_w.dtype)  # h_c, as the output kernel would read it back
        b_v = tl.load(u + o_t[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_v -= tl.dot(b_w, b_Sc, input_precision=DOT_PREC)
        b_vc = b_v.to(b_w.dtype)  # v_new, likewise
        if FUSE_OUTPUT:
            b_qg = tl.load(qg + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
            b_o = tl.dot(b_qg, b_Sc, input_precision=DOT_PREC)
            # the intra kernels may leave Aqk above the diagonal and past the sequence end unwritten
            m_A = m_t[:, None] & (o_t[:, None] >= o_t[None, :])
            b_A = tl.load(Aqk + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_A, other=0.0)
            b_o += tl.dot(b_A, b_vc, input_precision=DOT_PREC)
            tl.store(o + o_t[:, None] * (H * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        else:
            tl.store(h + o_k[:, None] * V + o_v[None, :], b_Sc.to(h.dtype.element_ty), mask=m_kv)
            tl.store(v_new + o_t[:, None] * (H * V) + o_v[None, :], b_vc.to(v_new.dtype.element_ty), mask=m_tv)
        b_kg = tl.load(kg + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        last = tl.minimum(T - i_t * BT, BT) - 1
        b_glast = tl.load(G + last * (H * K) + o_k, mask=m_k, other=0.0)
        b_S = b_S * tl.exp2(b_glast)[:, None]
        b_S += tl.dot(tl.trans(b_kg), b_vc, input_precision=DOT_PREC)
        h += H * K * V
        w += BT * H * K
        kg += BT * H * K
        G += BT * H * K
        u += BT * H * V
        v_new += BT * H * V
        qg += BT * H * K
        Aqk += BT * H * BT
        o += BT * H * V

    if STORE_FINAL_STATE:
        tl.store(ht + (slot * H + i_h) * (K * V) + offs_kv, b_S, mask=m_kv)


@triton.jit
def _decayed(x, G, r, c, rows, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKH: tl.constexpr):
    """Columns c .. c+BKH of the chunk's x (q or k) scaled per row by r, and of its log-decay G (fp32, zero past
    the sequence end)."""
    o_t = tl.arange(0, BT)
    o_k = c + tl.arange(0, BKH)
    mask = (o_t < rows)[:, None] & (o_k < K)[None, :]
    offs = o_t[:, None] * (H * K) + o_k[None, :]
    b_g = tl.load(G + offs, mask=mask, other=0.0)
    return tl.load(x + offs, mask=mask, other=0.0).to(tl.float32) * r[:, None], b_g


@triton.jit
def kda_chunk_state_wy_kernel(
    q,
    k,
    v,
    G,
    beta,
    Ai,
    rnorm,
    Aqk,
    o,
    h0,
    ht,
    state_indices,
    cu_seqlens,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BKH: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """The state pass with the WY products folded in: w, u, kg and qg never go through memory.

    With w = Ai (beta e^G k) and u = Ai (beta v), v_new = u - w S = Ai (beta (v - (e^G k) S)), so per chunk
    the pass reads q, k, v, G, beta, Ai and Aqk and computes::

        v_new = Ai (beta (v - (e^G k) S))
        o     = (scale e^G q) S + Aqk v_new
        S     = e^G_last S + (e^(G_last - G) k)^T v_new

    The state is carried as two halves of BKH key rows (K <= 2 BKH), so that only [BT, BKH] tiles of q, k and G
    are live at a time.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    q += bos * (H * K) + i_h * K
    k += bos * (H * K) + i_h * K
    G += bos * (H * K) + i_h * K
    v += bos * (H * V) + i_h * V
    o += bos * (H * V) + i_h * V
    beta += bos * H + i_h
    Ai += bos * (H * BT) + i_h * BT
    Aqk += bos * (H * BT) + i_h * BT
    rnorm += bos * (2 * H) + 2 * i_h

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BKH)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv0 = (o_k < K)[:, None] & m_v[None, :]
    m_kv1 = (BKH + o_k < K)[:, None] & m_v[None, :]
    slot = i_n.to(tl.int64)
    if USE_STATE_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    state = (slot * H + i_h) * (K * V)
    b_S0 = tl.zeros([BKH, BV], dtype=tl.float32)
    b_S1 = tl.zeros([BKH, BV], dtype=tl.float32)
    if HAS_INITIAL_STATE:
        b_S0 = tl.load(h0 + state + o_k[:, None] * V + o_v[None, :], mask=m_kv0, other=0.0).to(tl.float32)
        b_S1 = tl.load(h0 + state + (BKH + o_k)[:, None] * V + o_v[None, :], mask=m_kv1, other=0.0).to(tl.float32)

    for i_t in range(tl.cdiv(T, BT)):
        rows = tl.minimum(T - i_t * BT, BT)
        m_t = o_t < rows
        m_tv = m_t[:, None] & m_v[None, :]
        rq = tl.full([BT], scale, tl.float32)
        rk = tl.full([BT], 1.0, tl.float32)
        if L2NORM:  # 1/|q| and 1/|k| from the intra kernels
            rq *= tl.load(rnorm + o_t * (2 * H), mask=m_t, other=1.0)
            rk = tl.load(rnorm + o_t * (2 * H) + 1, mask=m_t, other=1.0)
        b_S0c = b_S0.to(q.dtype.element_ty)  # the states and v_new at the input precision, as the WY kernel's
        b_S1c = b_S1.to(q.dtype.element_ty)  # stored products would be
        b_k0, b_g0 = _decayed(k, G, rk, 0, rows, H, K, BT, BKH)
        b_q0, _ = _decayed(q, G, rq, 0, rows, H, K, BT, BKH)
        b_e0 = tl.exp2(b_g0)
        b_x = tl.dot((b_k0 * b_e0).to(b_S0c.dtype), b_S0c, input_precision=DOT_PREC)
        b_o = tl.dot((b_q0 * b_e0).to(b_S0c.dtype), b_S0c, input_precision=DOT_PREC)
        b_k1, b_g1 = _decayed(k, G, rk, BKH, rows, H, K, BT, BKH)
        b_q1, _ = _decayed(q, G, rq, BKH, rows, H, K, BT, BKH)
        b_e1 = tl.exp2(b_g1)
        b_x = tl.dot((b_k1 * b_e1).to(b_S1c.dtype), b_S1c, b_x, input_precision=DOT_PREC)
        b_o = tl.dot((b_q1 * b_e1).to(b_S1c.dtype), b_S1c, b_o, input_precision=DOT_PREC)

        b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
        b_v = tl.load(v + o_t[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_y = ((b_v - b_x) * b_b[:, None]).to(b_S0c.dtype)
        m_A = m_t[:, None] & (o_t[:, None] >= o_t[None, :])
        b_Ai = tl.load(Ai + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_A, other=0.0).to(b_S0c.dtype)
        b_vc = tl.dot(b_Ai, b_y, input_precision=DOT_PREC).to(b_S0c.dtype)  # v_new
        # the intra kernels may leave Aqk above the diagonal and past the sequence end unwritten
        b_A = tl.load(Aqk + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_A, other=0.0)
        b_o = tl.dot(b_A, b_vc, b_o, input_precision=DOT_PREC)
        tl.store(o + o_t[:, None] * (H * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)

        # k and G again (from cache): holding both halves across v_new would cost registers the state needs
        last = G + (rows - 1) * (H * K)
        b_k0, b_g0 = _decayed(k, G, rk, 0, rows, H, K, BT, BKH)
        b_gl0 = tl.load(last + o_k, mask=o_k < K, other=0.0)
        b_kg0 = (b_k0 * tl.exp2(b_gl0[None, :] - b_g0)).to(b_vc.dtype)
        b_S0 = tl.dot(tl.trans(b_kg0), b_vc, b_S0 * tl.exp2(b_gl0)[:, None], input_precision=DOT_PREC)
        b_k1, b_g1 = _decayed(k, G, rk, BKH, rows, H, K, BT, BKH)
        b_gl1 = tl.load(last + BKH + o_k, mask=BKH + o_k < K, other=0.0)
        b_kg1 = (b_k1 * tl.exp2(b_gl1[None, :] - b_g1)).to(b_vc.dtype)
        b_S1 = tl.dot(tl.trans(b_kg1), b_vc, b_S1 * tl.exp2(b_gl1)[:, None], input_precision=DOT_PREC)
        q += BT * H * K
        k += BT * H * K
        G += BT * H * K
        v += BT * H * V
        o += BT * H * V
        beta += BT * H
        Ai += BT * H * BT
        Aqk += BT * H * BT
        rnorm += BT * 2 * H

    if STORE_FINAL_STATE:
        tl.store(ht + state + o_k[:, None] * V + o_v[None, :], b_S0, mask=m_kv0)
        tl.store(ht + state + (BKH + o_k)[:, None] * V + o_v[None, :], b_S1, mask=m_kv1)
