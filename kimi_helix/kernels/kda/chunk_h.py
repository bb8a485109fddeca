"""Inter-chunk state recurrence of the Triton KDA prefill: the only sequential stage.

One program per (sequence, head, block of BV value columns) walks the chunks of its sequence carrying the state
``S [K, BV]`` in fp32 registers. Per chunk, with w, u from the WY kernel, and qg, kg, Aqk and the row factors
rq = scale/|q| (in rnorm) from the intra kernels::

    v_new = u - w S
    o     = rq * (qg S) + Aqk v_new            (FUSE_OUTPUT; else S and v_new are stored for the output kernel)
    S     = exp(G_last) * S + kg^T v_new        (kg = exp(G_last - G) * k)

q and k are not L2-normalised in qg and kg: rq multiplies the fp32 dot result, and 1/|k| is in u and w, so in
v_new, and left out of Aqk's columns (chunk_wy.py). v_new is therefore the true one times 1/|k|, also as stored
for the output kernel.

With FUSE_OUTPUT the output comes out of this pass, so neither the per-chunk states (K V values a chunk) nor
v_new go through memory; the extra loads (qg, Aqk) do not depend on the carried state, so they overlap it.
The initial state is read from, and the final state written back to, either a per-sequence tensor ``[N, H, K, V]``
or a slot of a state pool ``[slots, H, K, V]`` chosen by ``state_indices``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_helix.kernels.kda.jit import load_state, state_tile
from kimi_helix.kernels.sequences import sequence_span


@triton.jit
def _last_decay(G, n, o_k, m_k, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """G's last row in the chunk that starts at G and has n rows (at most BT count); zeros where n <= 0 (no
    chunk)."""
    return tl.load(G + (tl.minimum(n, BT) - 1) * (H * K) + o_k, mask=tl.where(n > 0, m_k, False), other=0.0)


@triton.jit
def kda_chunk_state_kernel(
    w,
    u,
    kg,
    G,
    qg,
    Aqk,
    rnorm,
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
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    FUSE_OUTPUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, slot = sequence_span(cu_seqlens, state_indices, i_n, 0, True, USE_STATE_INDICES)
    T = (eos - bos).to(tl.int32)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    w += bos * (H * K) + i_h * K
    kg += bos * (H * K) + i_h * K
    G += bos * (H * K) + i_h * K
    u += bos * (H * V) + i_h * V
    v_new += bos * (H * V) + i_h * V
    qg += bos * (H * K) + i_h * K
    Aqk += bos * (H * BT) + i_h * BT
    rnorm += bos * (2 * H) + 2 * i_h
    o += bos * (H * V) + i_h * V

    o_t = tl.arange(0, BT)
    o_k, o_v, m_k, m_v, m_kv, offs_kv = state_tile(i_v, K, V, BK, BV)
    b_S = load_state(h0, slot, i_h, offs_kv, m_kv, H, K, V, BK, BV, USE_INITIAL_STATE)

    h += (boh * H + i_h) * (K * V)
    # G's last row and the rows' scale/|q| feed no dot, so Triton's pipeliner leaves their loads inside the
    # iteration, which then waits for them: both are loaded a chunk ahead instead.
    b_glast = _last_decay(G, T, o_k, m_k, H, K, BT)
    b_rq = tl.zeros([BT], dtype=tl.float32)
    if FUSE_OUTPUT:
        b_rq = tl.load(rnorm + o_t * (2 * H), mask=o_t < T, other=0.0)
    for i_t in range(tl.cdiv(T, BT)):
        # the per-token pointers point at the current chunk (advanced below), so in-chunk offsets stay small. The
        # tile offsets are written out at each use, not hoisted into loop-invariant tensors: held across the loop
        # those spilled registers.
        n_next = T - (i_t + 1) * BT  # rows of the next chunk, <= 0 after the last
        b_glast_next = _last_decay(G + BT * (H * K), n_next, o_k, m_k, H, K, BT)
        b_rq_next = b_rq
        if FUSE_OUTPUT:
            b_rq_next = tl.load(rnorm + (BT + o_t) * (2 * H), mask=o_t < n_next, other=0.0)
        m_t = o_t < T - i_t * BT
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(w + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_Sc = b_S.to(b_w.dtype)  # h_c, as the output kernel would read it back
        b_v = tl.load(u + o_t[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_v -= tl.dot(b_w, b_Sc, input_precision=DOT_PRECISION)
        b_vc = b_v.to(b_w.dtype)  # v_new, likewise
        if FUSE_OUTPUT:
            b_qg = tl.load(qg + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
            b_o = tl.dot(b_qg, b_Sc, input_precision=DOT_PRECISION) * b_rq[:, None]
            # whole rows: the intra kernels store zeros above the diagonal, so the load takes no causal mask, which
            # would split it into 2-byte loads that cannot be pipelined
            b_A = tl.load(Aqk + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
            b_o += tl.dot(b_A, b_vc, input_precision=DOT_PRECISION)
            tl.store(o + o_t[:, None] * (H * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        else:
            tl.store(h + o_k[:, None] * V + o_v[None, :], b_Sc.to(h.dtype.element_ty), mask=m_kv)
            tl.store(v_new + o_t[:, None] * (H * V) + o_v[None, :], b_vc.to(v_new.dtype.element_ty), mask=m_tv)
        b_kg = tl.load(kg + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_S = b_S * tl.exp2(b_glast)[:, None]
        b_glast, b_rq = b_glast_next, b_rq_next
        b_S += tl.dot(tl.trans(b_kg), b_vc, input_precision=DOT_PRECISION)
        h += H * K * V
        w += BT * H * K
        kg += BT * H * K
        G += BT * H * K
        u += BT * H * V
        v_new += BT * H * V
        qg += BT * H * K
        Aqk += BT * H * BT
        rnorm += BT * 2 * H
        o += BT * H * V

    if STORE_FINAL_STATE:
        tl.store(ht + (slot * H + i_h) * (K * V) + offs_kv, b_S, mask=m_kv)
