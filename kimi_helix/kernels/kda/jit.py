"""Triton helpers shared by the KDA kernels: the forget gate from its raw pre-activation, and the ``[BK, BV]`` tile
of a head's fp32 state ``[K, V]`` that the recurrent and the chunked state pass keep in registers. One copy, so the
decode and prefill kernels cannot drift apart (the torch reference of the gate is ``naive.kda_gate``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["load_state", "log_decay", "softplus", "state_tile"]


@triton.jit
def softplus(x):
    """softplus with torch's threshold 20; log1p(e) as log(u) * e / (u - 1) cancels the rounding of u = 1 + e."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    d = u - 1.0
    lp = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def log_decay(x, rate, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """The fp32 log-decay of ``x = f + dt_bias`` with ``rate = exp(A_log)``: Kimi K3's ``lb * sigmoid(rate * x)``
    with USE_LOWER_BOUND, else Kimi-Linear's ``-rate * softplus(x)`` (``naive.kda_gate``)."""
    if USE_LOWER_BOUND:
        return lower_bound * tl.sigmoid(rate * x)
    return -rate * softplus(x)


@triton.jit
def state_tile(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Rows (all K) and columns (block i_v of BV) of a state tile: (o_k, o_v, m_k, m_v, m_kv, offsets in [K, V])."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    return o_k, o_v, m_k, m_v, m_k[:, None] & m_v[None, :], o_k[:, None] * V + o_v[None, :]


@triton.jit
def load_state(h0, slot, i_h, offs, mask, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):  # fmt: skip
    """The fp32 state tile of head i_h in pool (or batch) row ``slot`` of h0 [*, H, K, V]; zeros without one."""
    if USE_INITIAL_STATE:
        return tl.load(h0 + (slot * H + i_h) * (K * V) + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.zeros([BK, BV], dtype=tl.float32)
