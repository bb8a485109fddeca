"""Pure-PyTorch references for Kimi Delta Attention (KDA).

These are the correctness oracles for the Triton kernels and the CPU fallback of the model. They favour clarity
and numerical safety over speed: all maths runs in fp32, and every exponent is of a non-positive number (decays
are always taken between two points in causal order), so nothing overflows however strong the forget gate is.

Layouts follow fla: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]`` (log-decay); beta ``[B, T, H]``;
recurrent state ``[N, H, K, V]`` (fp32). Packed variable-length input has ``B == 1`` and ``cu_seqlens`` ``[N + 1]``.
"""

from __future__ import annotations

from functools import partial
from itertools import pairwise

import torch
import torch.nn.functional as F

from kimi_helix.kernels.common import check_shape, gather_states, scatter_states, segment_bounds
from kimi_helix.kernels.kda.common import check_intermediate_states, check_kda_inputs

__all__ = ["kda_gate", "l2norm", "naive_recurrent_kda", "naive_chunk_kda"]


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA forget gate: raw pre-activation -> fp32 log-decay.

    Args:
        f: ``[..., H, K]`` raw gate pre-activation (``f_b_proj`` output reshaped per head).
        A_log: any shape with ``H`` elements (Kimi checkpoints store ``[1, 1, H, 1]``).
        dt_bias: ``[H * K]`` (any shape with ``H * K`` elements).
        lower_bound: ``None`` for Kimi-Linear's softplus gate, or a negative float ``lb`` for Kimi K3's bounded gate.

    Returns:
        ``[..., H, K]`` fp32 log-decay ``g``:
        ``-exp(A_log[h]) * softplus(f + dt_bias)`` (beta 1, threshold 20), or
        ``lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`` when ``lower_bound`` is given (so ``g`` lies in ``[lb, 0]``).
    """
    if f.dim() < 2:
        raise ValueError(f"f must have shape [..., H, K], got {tuple(f.shape)}")
    H, K = f.shape[-2:]
    if A_log.numel() != H:
        raise ValueError(f"A_log must have H={H} elements, got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must have shape [H*K]=[{H * K}], got {tuple(dt_bias.shape)}")
    x = f.float() + dt_bias.float().reshape(H, K)
    rate = A_log.float().reshape(H, 1).exp()
    if lower_bound is None:
        return -rate * F.softplus(x, beta=1.0, threshold=20.0)
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    return lower_bound * torch.sigmoid(rate * x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla-style L2 normalisation over the last dim: ``x / sqrt(sum(x * x) + eps)`` in fp32.

    Unlike ``F.normalize`` the eps is added inside the square root (not clamped), which is what fla's kernels
    and the HF torch path do; results differ from ``F.normalize`` by O(eps / |x|^2).

    Args:
        x: ``[..., D]`` any float dtype.

    Returns:
        ``[..., D]`` fp32.
    """
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# --------------------------------------------------------------------------------------------------------------
# input handling shared by both references


def _segments(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[tuple[int, int]] | None:
    """Validate cu_seqlens and return [(start, end)] per sequence, or None for a plain batch."""
    if cu_seqlens is None:
        return None
    return list(pairwise(segment_bounds(cu_seqlens, B, T)))


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """Validate shapes; return fp32 (q scaled, k, v, g, beta), the fp32 initial state [N,H,K,V] and segments."""
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta)
    segs = _segments(cu_seqlens, B, T)
    N = B if segs is None else len(segs)
    if initial_state is None:
        state = q.new_zeros(N, H, K, V, dtype=torch.float32)
    else:
        check_shape("initial_state", initial_state, (N, H, K, V), "[N, H, K, V]")
        state = initial_state.float()

    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    # fla normalises in fp32 before scaling; the scale therefore multiplies a unit vector.
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (K**-0.5 if scale is None else scale)
    return q, k, v, g, beta, state, segs


def _run(fn, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """Validate and prepare the inputs (see :func:`_prepare`), then apply ``fn(q, k, v, g, beta, S) -> (o, final,
    extra)`` per batch (or per packed sequence). Returns ``(o in the input q's dtype, final, extra)``."""
    out_dtype = q.dtype
    q, k, v, g, beta, state, segs = _prepare(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens
    )
    tensors = (q, k, v, g, beta)
    if segs is None:
        o, final, extra = fn(*tensors, state)
        return o.to(out_dtype), final, extra
    lens = {e - s for s, e in segs}
    if len(lens) == 1:
        # Equal-length packed sequences (training batches) run as one batch instead of one call per sequence.
        n, L = len(segs), lens.pop()
        o, final, extra = fn(*(t.reshape(n, L, *t.shape[2:]) for t in tensors), state)
        return o.reshape(1, n * L, *o.shape[2:]).to(out_dtype), final, extra
    outs, finals, extras = [], [], []
    for n, (s, e) in enumerate(segs):
        o, final, extra = fn(*(t[:, s:e] for t in tensors), state[n : n + 1])
        outs.append(o)
        finals.append(final)
        extras.append(extra)
    extra = None if extras[0] is None else torch.cat(extras, dim=0)
    return torch.cat(outs, dim=1).to(out_dtype), torch.cat(finals, dim=0), extra


# --------------------------------------------------------------------------------------------------------------
# token-by-token recurrence


def _recurrent_segment(q, k, v, g, beta, S, keep_states):
    """q,k,g [n,L,H,K]; v [n,L,H,V]; beta [n,L,H]; S [n,H,K,V] -> (o [n,L,H,V], S, states [n*L,H,K,V] | None)."""
    n, L, H, _ = q.shape
    o = q.new_empty(n, L, H, v.shape[-1])
    states = [] if keep_states else None
    for t in range(L):
        S = S * g[:, t].exp().unsqueeze(-1)
        # prediction error of the decayed memory for this key, gated by beta (the delta rule)
        err = v[:, t] - torch.einsum("nhkv,nhk->nhv", S, k[:, t])
        S = S + k[:, t].unsqueeze(-1) * (beta[:, t].unsqueeze(-1) * err).unsqueeze(-2)
        o[:, t] = torch.einsum("nhkv,nhk->nhv", S, q[:, t])
        if keep_states:
            states.append(S)
    if keep_states:
        # token order within the packed output is batch-major, matching o.reshape(n * L, ...)
        states = torch.stack(states, dim=1).reshape(n * L, *S.shape[1:]) if L else S.new_empty(0, *S.shape[1:])
    return o, S, states


# twin of kda/fused_recurrent.py:fused_recurrent_kda_triton (same signature and contract; naive_chunk_kda shares
# the arguments but the verify ones) — a fix here belongs there too
def naive_recurrent_kda(
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
    """Token-by-token KDA reference.

    Per step with state ``S [K, V]``::

        S = S * exp(g_t)[:, None];  v' = beta_t * (v_t - S^T k_t);  S = S + k_t v'^T;  o_t = S^T (q_t * scale)

    The output reads the *updated* state.

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, H, V]``.  g: ``[B, T, H, K]`` log-decay.  beta: ``[B, T, H]``.
        scale: multiplies q after the optional L2 norm; defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of packed sequences) or None for zeros.
        output_final_state: also return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k (fla eps 1e-6, see :func:`l2norm`) before use.
        cu_seqlens: ``[N + 1]`` int32/int64 sequence boundaries of a packed ``B == 1`` input.
        state_indices: ``[N]``: ``initial_state`` is then a state pool ``[slots, H, K, V]``; sequence i reads slot
            ``state_indices[i]`` and, with ``output_final_state``, its final state is written back there in place
            (the pool is returned).
        return_intermediate_states: return every per-token state instead of the final one.
        A_log, dt_bias, lower_bound: when given, ``g`` is the raw gate pre-activation and the log-decay is
            ``kda_gate(g, A_log, dt_bias, lower_bound)``.
        intermediate_states: with ``return_intermediate_states``, a contiguous fp32 ``[B * T, H, K, V]`` buffer
            the per-token states are copied into and which is returned; None allocates.
        use_beta_sigmoid_in_kernel: ``beta`` is the pre-activation (logits); ``sigmoid`` is applied in fp32.

    Returns:
        ``(o [B, T, H, V] in q.dtype, final_state [N, H, K, V] fp32 or None)``; with
        ``return_intermediate_states=True`` the second item is ``[B * T, H, K, V]`` fp32, the state after each
        token in packed token order (for rolling back speculative decoding).
    """
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta)
    check_intermediate_states(intermediate_states, return_intermediate_states, B * T, H, K, V, q.device)
    fn = partial(_recurrent_segment, keep_states=return_intermediate_states)
    g = _log_decay(g, A_log, dt_bias, lower_bound)
    beta = beta.float().sigmoid() if use_beta_sigmoid_in_kernel else beta
    state = gather_states(initial_state, state_indices)
    o, final, states = _run(fn, q, k, v, g, beta, scale, state, use_qk_l2norm_in_kernel, cu_seqlens)
    if output_final_state and state_indices is not None:
        final = scatter_states(initial_state, state_indices, final)
    if return_intermediate_states:
        return o, states if intermediate_states is None else intermediate_states.copy_(states)
    return o, final if output_final_state else None


def _log_decay(g, A_log, dt_bias, lower_bound):
    """`g` itself, or the gate computed from the raw pre-activation when `A_log`/`dt_bias` are given."""
    if (A_log is None) != (dt_bias is None) or (lower_bound is not None and A_log is None):
        raise ValueError("A_log and dt_bias must be given together (lower_bound only with them)")
    return g if A_log is None else kda_gate(g, A_log, dt_bias, lower_bound)


# --------------------------------------------------------------------------------------------------------------
# chunked (WY / UT-transform) form


def _chunk_segment(q, k, v, g, beta, S, chunk_size):
    """Same contract as :func:`_recurrent_segment` (no intermediate states), one chunk at a time."""
    n, L, H, _ = q.shape
    # head-major so the per-chunk matrices are plain batched matmuls over (n, H)
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    beta = beta.transpose(1, 2)
    o = q.new_empty(n, H, L, v.shape[-1])
    for s in range(0, L, chunk_size):
        e = min(s + chunk_size, L)
        C = e - s
        qc, kc, vc, bc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e]
        gc = g[:, :, s:e]
        G = gc.cumsum(dim=2)  # [n,H,C,K]: log-decay from the chunk start through token i
        # seg[i, j] = sum_{j < t <= i} g_t, the per-channel log-decay between tokens j and i. Summing only the
        # terms in between (instead of G_i - G_j) keeps it accurate when G itself is large, e.g. after a
        # near-reset of some channels, and never forms exp(-G_j), which overflows below about -88.
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        later = causal.tril(-1)  # [t, j]: t > j
        seg = gc.unsqueeze(3).expand(-1, -1, -1, C, -1).masked_fill(~later[:, :, None], 0.0).cumsum(dim=2)
        decay = seg.masked_fill(~causal[:, :, None], float("-inf")).exp()  # [n,H,C,C,K]; zero above diagonal
        kk = torch.einsum("nhik,nhjk,nhijk->nhij", kc, kc, decay)
        qk = torch.einsum("nhik,nhjk,nhijk->nhij", qc, kc, decay)
        # (I + A) with A[i,j] = beta_i k_i.(decay_ij k_j) for j < i; solving against it is the UT transform
        # T = (I + A)^-1 Diag(beta) applied on the fly.
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        IA = eye + (bc.unsqueeze(-1) * kk).masked_fill(~later, 0.0)
        rhs = torch.cat([bc.unsqueeze(-1) * vc, bc.unsqueeze(-1) * G.exp() * kc], dim=-1)
        sol = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)
        u, w = sol.split([vc.shape[-1], kc.shape[-1]], dim=-1)
        v_new = u - w @ S  # the beta-gated delta-rule corrections v' of the chunk, given the carried state
        o[:, :, s:e] = (qc * G.exp()) @ S + qk @ v_new
        to_end = seg[:, :, -1]  # [n,H,C,K]: log-decay from each token to the chunk end
        S = G[:, :, -1].unsqueeze(-1).exp() * S + (to_end.exp() * kc).transpose(-1, -2) @ v_new
    return o.transpose(1, 2), S, None


# twin of kda/chunk.py:chunk_kda_triton (same signature and contract; naive_recurrent_kda shares the arguments)
# — a fix here belongs there too
def naive_chunk_kda(
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
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY / UT-transform) KDA reference; same arguments and results as :func:`naive_recurrent_kda`.

    Each sequence (batch row, or packed sequence under ``cu_seqlens``) is cut into chunks of ``chunk_size``
    tokens (the last one may be shorter) carrying its own state. Within a chunk, with ``G`` the in-chunk
    cumulative sum of ``g`` and the state ``S`` at the chunk start::

        A[i,j]  = beta_i sum_d k_id k_jd exp(G_id - G_jd)   (j < i)
        u       = (I + A)^-1 (beta * v);   w = (I + A)^-1 (beta * exp(G) * k)
        v_new   = u - w S
        o       = (q * exp(G)) S + Aqk v_new,  Aqk[i,j] = sum_d q_id k_jd exp(G_id - G_jd)  (j <= i)
        S      <- exp(G_last) * S + (exp(G_last - G) * k)^T v_new

    The differences ``G_i - G_j`` are formed as sums of the gates in between, so the result stays within fp32
    rounding of the recurrent form even when the cumulative decay is huge (fla and the transformers torch path
    subtract cumsums, which loses ~ulp(|G|) in the exponent).

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, H, V]``.  g: ``[B, T, H, K]`` log-decay.  beta: ``[B, T, H]``.
        scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, state_indices, A_log,
            dt_bias, lower_bound, use_beta_sigmoid_in_kernel: as in :func:`naive_recurrent_kda`.
        chunk_size: tokens per chunk (64 in fla).

    Returns:
        ``(o [B, T, H, V] in q.dtype, final_state [N, H, K, V] fp32 or None)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    fn = partial(_chunk_segment, chunk_size=chunk_size)
    g = _log_decay(g, A_log, dt_bias, lower_bound)
    beta = beta.float().sigmoid() if use_beta_sigmoid_in_kernel else beta
    state = gather_states(initial_state, state_indices)
    o, final, _ = _run(fn, q, k, v, g, beta, scale, state, use_qk_l2norm_in_kernel, cu_seqlens)
    if output_final_state and state_indices is not None:
        final = scatter_states(initial_state, state_indices, final)
    return o, final if output_final_state else None
