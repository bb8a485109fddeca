"""Sigmoid-routed mixture of experts with shared experts (DeepSeek-V3 / Kimi-Linear routing).

Routing: scores = sigmoid(x W_g^T) in fp32; the *selection* adds `e_score_correction_bias` (group-limited top-k);
the *weights* are the unbiased scores of the chosen experts, renormalised, times `routed_scaling_factor`. This is
the convention of transformers' native KimiLinear, vLLM and SGLang (the HF remote code adds the bias in place and
so also to the weights; we do not copy that).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.backends import BackendChoice
from ..kernels.moe import SharedExperts, fused_experts
from ..kernels.router import moe_router
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
        self.backends = BackendChoice()  # the model's choice, set by `KimiK3Model.set_backends`

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k] fp32, expert ids [T, k] int64) (`kernels.router`: fused on the GPU)."""
        return moe_router(
            x,
            self.weight,
            self.e_score_correction_bias,
            self.top_k,
            self.num_groups,
            self.topk_group,
            self.renormalize,
            self.scaling,
            self.activation,
            backend=self.backends.kernels,
        )


class RoutedExperts(nn.Module):
    """All routed experts of one layer, stacked so grouped kernels can read them in place.

    `gate_up_proj` [E, 2I, d] holds each expert's `w1` (gate) over `w3` (up); `down_proj` [E, d, I] is `w2`.
    Checkpoints store them per expert (`experts.{e}.w1.weight`, ...); `checkpoint.py` converts.
    """

    # `forward` takes the block's shared experts and runs them in the same kernels (read by `SparseMoE`)
    fuses_shared_experts = True

    def __init__(self, config: KimiK3Config):
        super().__init__()
        e, i, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.backends = BackendChoice()  # the model's choice, set by `KimiK3Model.set_backends`

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared: SwiGLU | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, d]; weights, ids [T, k] -> [T, d] (`kernels.moe.fused_experts`: Triton on the GPU).

        `shared`, the block's shared experts, joins the same kernels at weight 1, its weights read in place;
        `residual` [T, d] is added inside them (the decoder layer's residual add, one launch fewer).
        """
        shared_weights = None
        if shared is not None:
            shared_weights = SharedExperts(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
        return fused_experts(
            x, self.gate_up_proj, self.down_proj, weights, ids, shared_weights, residual, backend=self.backends.kernels
        )


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] -> [T, d]; with `residual` [T, d], `residual + moe(x)` (added inside the experts' kernels
        where they take the shared experts too)."""
        weights, ids = self.gate(x)
        shared = self.shared_experts
        # apart: for experts that take no shared experts (tensor parallelism's expert-parallel ones), and for shared
        # experts a device map put on another device (their own hooks move x there)
        if getattr(self.experts, "fuses_shared_experts", False) and (
            shared is None or shared.down_proj.weight.device == x.device
        ):
            return self.experts(x, weights, ids, shared, residual)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if residual is None else residual + out
