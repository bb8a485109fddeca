"""MOE: the torch references against independent oracles (dense softmax, transformers, loops)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix import KimiK3Config
from kimi_helix.kernels.moe import fused_experts_ref, moe_router_ref
from kimi_helix.modeling.moe import RoutedExperts, TopkRouter

from .conftest import D, E, I, K, make_experts, make_tokens


def router_config(**overrides):
    kw = dict(hidden_size=D, num_experts=E, num_experts_per_token=K, moe_intermediate_size=I)
    kw.update(overrides)
    return KimiK3Config(**kw)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2, "num_experts_per_token": 3},
        {"moe_router_activation_func": "softmax", "routed_scaling_factor": 1.0},
        {"moe_renormalize": False},
    ],
)
def test_router_ref_matches_topk_router(overrides):
    cfg = router_config(**overrides)
    router = TopkRouter(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.rand(E, generator=g) * 0.5)
        x = torch.randn(9, D, generator=g).half()
        expected_w, expected_ids = router(x)
    weights, ids = moe_router_ref(
        x,
        router.weight,
        router.e_score_correction_bias,
        router.top_k,
        router.num_groups,
        router.topk_group,
        router.renormalize,
        router.scaling,
        router.activation,
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_w)


def test_router_ref_rejects_bad_arguments():
    x, w = torch.randn(2, D), torch.randn(E, D)
    with pytest.raises(ValueError, match="activation"):
        moe_router_ref(x, w, None, 2, activation="relu")
    with pytest.raises(ValueError, match="num_groups"):
        moe_router_ref(x, w, None, 2, num_groups=3, topk_group=1)


def test_ref_matches_routed_experts():
    experts = RoutedExperts(router_config())
    gate_up, down = make_experts(E, D, I, torch.float32, device="cpu")
    x, weights, ids = make_tokens(7, D, E, K, torch.float32, device="cpu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        expected = experts(x, weights, ids)
    assert torch.equal(fused_experts_ref(x, gate_up, down, weights, ids), expected)
