"""Sigmoid-routed mixture of experts with shared experts (DeepSeek-V3 / Kimi-Linear routing).

Routing: scores = sigmoid(x W_g^T) in fp32; the *selection* adds `e_score_correction_bias` (group-limited top-k);
the *weights* are the unbiased scores of the chosen experts, renormalised, times `routed_scaling_factor`. This is
the convention of transformers' native KimiLinear, vLLM and SGLang (the HF remote code adds the bias in place and
so also to the weights; we do not copy that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import KimiK3Config
from .layers import SwiGLU


class TopkRouter(nn.Module):
    """The `gate` of a MoE block: weight [E, d] and `e_score_correction_bias` [E], both kept in fp32."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_groups = config.num_expert_group if config.use_grouped_topk else 1
        self.topk_group = config.topk_group if config.use_grouped_topk else 1
        self.activation = config.moe_router_activation_func
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.activation == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.float()
        if self.num_groups > 1:
            grouped = choice.view(x.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class RoutedExperts(nn.Module):
    """All routed experts of one layer, stacked so grouped kernels can read them in place.

    `gate_up_proj` [E, 2I, d] holds each expert's `w1` (gate) over `w3` (up); `down_proj` [E, d, I] is `w2`.
    Checkpoints store them per expert (`experts.{e}.w1.weight`, ...); `checkpoint.py` converts.
    """

    def __init__(self, config: KimiK3Config):
        super().__init__()
        e, i, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Reference loop over the experts that received tokens. x [T, d]; weights, ids [T, k] -> [T, d]."""
        out = torch.zeros_like(x)
        top_k = ids.shape[1]
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        for expert, pairs in enumerate(order.split(counts)):
            if pairs.numel() == 0:
                continue
            tokens = pairs // top_k
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, (y * weights.flatten()[pairs, None]).to(x.dtype))
        return out


class SparseMoE(nn.Module):
    """`block_sparse_moe`: router, routed experts and (unscaled) shared experts."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = RoutedExperts(config)
        n_shared = config.num_shared_experts
        self.shared_experts = (
            SwiGLU(config.hidden_size, config.moe_intermediate_size * n_shared) if n_shared > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
