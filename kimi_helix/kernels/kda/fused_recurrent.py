"""Triton fused recurrent KDA for decode (T = 1 per sequence) and speculative verify (T = k + 1).

One program owns the ``[K, BV]`` slice of one head's fp32 state of one sequence and keeps it in registers while it
walks that sequence's tokens, so the state, which dominates the traffic (2 MiB per sequence and layer at Kimi-Linear
shapes), is read once and written once however many tokens are verified. Decode is therefore a state copy with a
little arithmetic: the target is the device copy bandwidth.

The state may live in an engine pool ``[slots, H, K, V]`` addressed by ``state_indices`` and is then updated in
place; the forget gate may be computed in the kernel from its raw pre-activation (``kda_gate`` semantics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_cu_seqlens, check_device, check_index, check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.kda.common import (
    check_gate_args,
    check_intermediate_states,
    check_kda_inputs,
    check_state,
)
from kimi_helix.kernels.kda.jit import load_state, log_decay, state_tile
from kimi_helix.kernels.launch import cdiv, next_pow2
from kimi_helix.kernels.sequences import sequence_span

__all__ = ["CAPS", "fused_recurrent_kda_triton"]

# What this kernel serves, read by the backend switch: the [K, V] state tile lives in registers, so K is a power of
# two in [16, 256].
CAPS = OpCaps(triton_devices(), FLOATS, head_dims=(16, 256))

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def fused_recurrent_kda_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    h0,
    ht,
    hs,
    cu_seqlens,
    state_indices,
    A_log,
    dt_bias,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_g_t,
    stride_g_h,
    stride_b_t,
    stride_b_h,
    scale,
    lower_bound,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    STORE_ALL_STATES: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
):
    # A 1-d grid (CUDA caps the other axes at 65535) with the V-blocks of one head adjacent, so neighbouring
    # programs stream neighbouring columns of the same rows of the state.
    NV = tl.cdiv(V, BV)
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    i_n = (i_nh // H).to(tl.int64)
    i_h = i_nh % H
    bos, eos, slot = sequence_span(cu_seqlens, state_indices, i_n, T, IS_VARLEN, USE_STATE_INDICES)

    o_k, o_v, mask_k, mask_v, mask_kv, off_kv = state_tile(i_v, K, V, BK, BV)
    b_h = load_state(h0, slot, i_h, off_kv, mask_kv, H, K, V, BK, BV, USE_INITIAL_STATE)
    if GATE_IN_KERNEL:
        b_rate = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        b_bias = tl.load(dt_bias + i_h * K + o_k, mask=mask_k, other=0.0).to(tl.float32)

    # A block's tokens are loaded (and normalised, gated) together, then walked one by one: the loads of a verify
    # group are in flight at once instead of one token's after another's update.
    o_t = tl.arange(0, BT)
    for t0 in range(bos, eos, BT):
        tok = t0 + o_t
        ok_t = tok < eos
        m_tk = ok_t[:, None] & mask_k[None, :]
        Q = tl.load(q + tok[:, None] * stride_q_t + i_h * stride_q_h + o_k[None, :], mask=m_tk, other=0.0)
        Kt = tl.load(k + tok[:, None] * stride_k_t + i_h * stride_k_h + o_k[None, :], mask=m_tk, other=0.0)
        Vt = tl.load(v + tok[:, None] * stride_v_t + i_h * stride_v_h + o_v[None, :],
                     mask=ok_t[:, None] & mask_v[None, :], other=0.0)  # fmt: skip
        G = tl.load(g + tok[:, None] * stride_g_t + i_h * stride_g_h + o_k[None, :], mask=m_tk, other=0.0)
        B = tl.load(beta + tok * stride_b_t + i_h * stride_b_h, mask=ok_t, other=0.0).to(tl.float32)
        Q, Kt, Vt, G = Q.to(tl.float32), Kt.to(tl.float32), Vt.to(tl.float32), G.to(tl.float32)
        if USE_BETA_SIGMOID:
            B = tl.sigmoid(B)
        if USE_QK_L2NORM:
            Q = Q / tl.sqrt(tl.sum(Q * Q, axis=1) + 1e-6)[:, None]
            Kt = Kt / tl.sqrt(tl.sum(Kt * Kt, axis=1) + 1e-6)[:, None]
        Q = Q * scale
        if GATE_IN_KERNEL:
            G = log_decay(G + b_bias[None, :], b_rate, lower_bound, USE_LOWER_BOUND)
        G = tl.exp(G)
        for j in tl.static_range(BT):
            if t0 + j < eos:
                row = o_t == j
                b_q = tl.sum(tl.where(row[:, None], Q, 0.0), axis=0)
                b_k = tl.sum(tl.where(row[:, None], Kt, 0.0), axis=0)
                b_v = tl.sum(tl.where(row[:, None], Vt, 0.0), axis=0)
                b_h *= tl.sum(tl.where(row[:, None], G, 0.0), axis=0)[:, None]
                # delta rule: store beta * (v - S^T k), the prediction error of the decayed memory for this key
                b_v = tl.sum(tl.where(row, B, 0.0)) * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
                b_h += b_k[:, None] * b_v[None, :]
                b_o = tl.sum(b_h * b_q[:, None], axis=0)
                t = t0 + j
                tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
                if STORE_ALL_STATES:
                    tl.store(hs + (t * H + i_h) * (K * V) + off_kv, b_h, mask=mask_kv)

    if STORE_FINAL_STATE:
        tl.store(ht + (slot * H + i_h) * (K * V) + off_kv, b_h.to(ht.dtype.element_ty), mask=mask_kv)


# Tokens loaded together, at most: a verify group of 1 + k <= 9 tokens takes one or two blocks.
_BLOCK_T = 8


def _config(N: int, H: int, K: int, V: int, tokens_per_seq: int) -> tuple[int, int, int]:
    """(BV, num_warps, BT). A [K, 32] fp32 tile is 32 registers a thread at 4 warps. With few sequences the kernel
    is bound by latency: BV drops to 16 so that more programs, hence more state loads, are in flight, and a
    sequence's tokens are loaded BT at a time (up to 8, the power of two at or above its mean tokens) so that a
    verify group's loads overlap. There a state tile of at most 32 registers a thread at one warp (K <= 64) takes
    one warp: every reduction over K or over the block's tokens stays within the warp (shuffles, no shared-memory
    round trips; `scripts/profile_round.py --kda-warps` compares a round's kernels). With many programs BT stays
    1: picking a token out of a block (a reduction over the block's rows each) then costs more than the loads'
    latency, which other programs hide (docs/benchmarks.md, KDA decode; `scripts/bench_kda.py --phase decode
    --sweep` times the alternatives)."""
    bv = min(next_pow2(V), 32)
    bt, num_warps = 1, 4
    if N * H * cdiv(V, bv) < 1024:
        bv = min(bv, 16)
        bt = min(_BLOCK_T, next_pow2(max(1, tokens_per_seq)))
        num_warps = 1 if next_pow2(K) * bv <= 32 * 32 else 4
    return bv, num_warps, bt


def _check_inputs(q, k, v, g, beta, cu_seqlens) -> int:
    """Dtypes and devices of the inputs and the packed boundaries; returns N, the number of sequences."""
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype must be fp32, fp16 or bf16, got {t.dtype}")
        check_device(name, t, q.device)
    check_triton_device("q", q)
    if cu_seqlens is None:
        return q.shape[0]
    N = check_cu_seqlens(cu_seqlens, q.shape[0])
    check_device("cu_seqlens", cu_seqlens, q.device)
    return N


def _token_major(name: str, x: torch.Tensor, ndim: int) -> tuple[torch.Tensor, int, int]:
    """View ``[B, T, H(, D)]`` as token-major rows ``[B*T, H(, D)]``; returns it with its (token, head) strides."""
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {list(x.shape)}")
    x = x.flatten(0, 1)
    if ndim == 4 and x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(1)


# twin of kda/naive.py:naive_recurrent_kda (same signature and contract; chunk.py:chunk_kda_triton shares the
# arguments but the verify ones) — a fix here belongs there too
def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    return_intermediate_states: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    intermediate_states: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA in one kernel; the contract of ``naive_recurrent_kda`` plus a state pool and a fused gate.

    Per step with state ``S [K, V]``: ``S = S * exp(g_t)[:, None]; v' = beta_t (v_t - S^T k_t); S = S + k_t v'^T;
    o_t = S^T (q_t * scale)``. All maths is fp32. Sequence boundaries are not validated on the host (that would
    sync): ``cu_seqlens`` must be non-decreasing from 0 to ``T`` and ``state_indices`` distinct and in range.

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, H, V]``.  beta: ``[B, T, H]``.  Any float dtype. Read in place when
            the last dim is contiguous and B, T flatten to one token axis (e.g. slices of a fused qkv projection);
            copied otherwise.
        g: ``[B, T, H, K]`` fp32 log-decay, or the raw gate pre-activation when ``A_log`` is given.
        scale: multiplies q after the optional L2 norm; defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of packed sequences) or None for zeros; with
            ``state_indices``, the contiguous fp32 POOL ``[slots, H, K, V]``.
        output_final_state: return the state after each sequence's last token; with ``state_indices`` it is
            written IN PLACE into the pool (only the listed slots change) and the pool is returned.
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(sum(x^2) + 1e-6)``) before use.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of a packed ``B == 1`` input.
        state_indices: ``[N]`` int32/int64 pool slot of each sequence.
        return_intermediate_states: return the state after every token instead of the final one (for rolling back
            speculative decoding); a pool is still updated in place when ``output_final_state``.
        A_log: ``H`` elements; with ``dt_bias`` (``H * K`` elements), ``g`` is the raw pre-activation ``f`` and the
            kernel applies ``kda_gate(f, A_log, dt_bias, lower_bound)``.
        dt_bias: see ``A_log``.
        lower_bound: negative bound of Kimi K3's sigmoid gate, or None for Kimi-Linear's softplus gate.
        intermediate_states: with ``return_intermediate_states``, a preallocated contiguous fp32
            ``[B * T, H, K, V]`` buffer the per-token states are written into (and which is returned), so that a
            CUDA-graph replay writes to a static address; None allocates.
        use_beta_sigmoid_in_kernel: ``beta`` is the pre-activation (logits): the kernel applies ``sigmoid`` in
            fp32 (no separate cast and sigmoid kernels).

    Returns:
        ``(o [B, T, H, V] in q.dtype, final_state)``: ``final_state`` is ``[N, H, K, V]`` fp32 (the pool itself with
        ``state_indices``) or None; with ``return_intermediate_states`` it is ``[B * T, H, K, V]`` fp32 in packed
        token order.
    """
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta)
    N = _check_inputs(q, k, v, g, beta, cu_seqlens)
    check_gate_args(A_log, dt_bias, lower_bound, H, K)
    if A_log is not None:
        A_log, dt_bias = A_log.reshape(H).contiguous(), dt_bias.reshape(H * K).contiguous()
    if state_indices is not None:
        check_index("state_indices", state_indices, N, q.device)
    initial_state = check_state(initial_state, state_indices, N, H, K, V, q.device)
    check_intermediate_states(intermediate_states, return_intermediate_states, B * T, H, K, V, q.device)

    q_, sqt, sqh = _token_major("q", q, 4)
    k_, skt, skh = _token_major("k", k, 4)
    v_, svt, svh = _token_major("v", v, 4)
    g_, sgt, sgh = _token_major("g", g, 4)
    b_, sbt, sbh = _token_major("beta", beta, 3)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    states = intermediate_states
    if return_intermediate_states and states is None:
        states = torch.empty(B * T, H, K, V, dtype=torch.float32, device=q.device)
    final = None
    if output_final_state and state_indices is not None:
        final = initial_state
    elif output_final_state and not return_intermediate_states:
        final = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    bv, num_warps, bt = _config(N, H, K, V, cdiv(B * T, max(N, 1)))
    grid = (N * H * cdiv(V, bv),)
    fused_recurrent_kda_fwd_kernel[grid](
        q_, k_, v_, g_, b_, o, initial_state, final, states, cu_seqlens, state_indices, A_log, dt_bias,
        sqt, sqh, skt, skh, svt, svh, sgt, sgh, sbt, sbh,
        K**-0.5 if scale is None else scale, 0.0 if lower_bound is None else lower_bound, T,
        H=H, K=K, V=V, BK=next_pow2(K), BV=bv, BT=bt,
        IS_VARLEN=cu_seqlens is not None,
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=final is not None,
        STORE_ALL_STATES=states is not None,
        USE_STATE_INDICES=state_indices is not None,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel,
        GATE_IN_KERNEL=A_log is not None,
        USE_LOWER_BOUND=lower_bound is not None,
        USE_BETA_SIGMOID=use_beta_sigmoid_in_kernel,
        num_warps=num_warps,
    )  # fmt: skip
    if return_intermediate_states:
        return o, states
    return o, final
