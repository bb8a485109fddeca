"""Pure-PyTorch references for the MoE: sigmoid top-k routing and the loop over the routed (and shared) experts.

Routing follows `kimi_helix.modeling.moe.TopkRouter` (DeepSeek-V3 / Kimi-Linear): scores are computed in fp32;
the *selection* adds `e_score_correction_bias` (optionally limited to the best expert groups); the *weights* are
the unbiased scores of the chosen experts, renormalised, times the scaling factor. Experts are stacked:
`gate_up_proj` [E, 2I, d] holds each expert's gate (w1) over its up (w3) projection, `down_proj` [E, d, I] is w2.
The shared experts are one SwiGLU of intermediate I_s, applied to every token at weight 1 (`SharedExperts`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["SharedExperts", "fused_experts_ref", "moe_router_ref"]


# Twin of kernels/router/triton.py:moe_router_triton (same signature and results): a change to one belongs in both.
def moe_router_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    activation: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose `top_k` experts per token; device ops only (no host sync), so it can run inside a CUDA graph.

    Args:
        x: [T, d] hidden states, any float dtype (the maths runs in fp32).
        weight: [E, d] router weight.
        bias: [E] `e_score_correction_bias`, added for the selection only; None for no bias.
        top_k: experts per token.
        num_groups, topk_group: group-limited routing: experts form `num_groups` equal groups, a group is scored
            by the sum of its two best (biased) scores, and only the `topk_group` best groups are eligible.
            `num_groups == 1` disables it.
        renormalize: divide the chosen scores by their sum.
        scaling: `routed_scaling_factor`, applied after renormalisation.
        activation: "sigmoid" (Kimi) or "softmax".

    Returns:
        (weights [T, top_k] fp32, ids [T, top_k] int64).
    """
    if activation not in ("sigmoid", "softmax"):
        raise ValueError(f"activation must be 'sigmoid' or 'softmax', got {activation!r}")
    num_experts = weight.shape[0]
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the {num_experts} experts")
    logits = F.linear(x.float(), weight.float())
    scores = logits.sigmoid() if activation == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if num_groups > 1:
        grouped = choice.view(x.shape[0], num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        # the epsilon keeps an all-zero row (every chosen score underflowed) finite, as in TopkRouter
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class SharedExperts(NamedTuple):
    """The shared experts' SwiGLU weights, read in place (`shared_experts.{gate,up,down}_proj.weight`).

    gate, up: [I_s, d]; down: [d, I_s]. I_s is `moe_intermediate_size * num_shared_experts` (divided by the
    ranks under tensor parallelism).
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


# Twin of triton.py:fused_experts_triton (same signature and maths): a change to one belongs in both.
def fused_experts_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: SharedExperts | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts, plus the shared experts and `residual` if given, as a loop over the experts that received
    tokens (syncs with the host: a reference only).

    `out[t] = sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])) + shared(x[t])` with
    `e = ids[t, j]` and `shared` the SwiGLU `shared.down @ (silu(shared.gate @ x) * (shared.up @ x))`. Each
    expert's matmuls run in x.dtype; the weighted contributions are summed in fp32 (at least) and rounded to
    x.dtype once, as the Triton kernels' in-register combine does.

    Args:
        x: [T, d].
        gate_up_proj: [E, 2I, d], gate rows over up rows.
        down_proj: [E, d, I].
        weights: [T, k] fp32 routing weights.
        ids: [T, k] expert ids.
        shared: the shared experts' weights (weight 1, every token), or None.
        residual: [T, d] in x.dtype, added to the fp32 sum before its rounding (a pre-norm block's residual), or
            None.

    Returns:
        [T, d] in x.dtype.
    """
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=acc_dtype, device=x.device)
    top_k = ids.shape[1]
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    for expert, pairs in enumerate(order.split(counts)):
        if pairs.numel() == 0:
            continue
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[expert])
        out.index_add_(0, tokens, y.to(acc_dtype) * weights.flatten()[pairs, None].to(acc_dtype))
    if shared is not None:
        gate, up, down = shared
        out += F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down).to(acc_dtype)
    if residual is not None:
        out += residual.to(acc_dtype)
    return out.to(x.dtype)
