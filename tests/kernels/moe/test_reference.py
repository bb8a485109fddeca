"""MOE: the torch references against independent oracles (dense softmax, transformers, loops)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix import KimiK3Config
from kimi_helix.kernels.backends import BackendChoice
from kimi_helix.kernels.moe import fused_experts_ref, moe_router_ref
from kimi_helix.modeling.layers import SwiGLU
from kimi_helix.modeling.moe import RoutedExperts, SparseMoE, TopkRouter

from .conftest import D, E, I, K, make_experts, make_shared, make_tokens


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


def test_ref_shared_experts_equal_a_separate_swiglu():
    # the shared experts at weight 1 inside the routed sum are the SwiGLU module added after it
    gate_up, down = make_experts(E, D, I, torch.float32, device="cpu")
    shared = make_shared(D, 2 * I, torch.float32, device="cpu")
    x, weights, ids = make_tokens(7, D, E, K, torch.float32, device="cpu")
    swiglu = SwiGLU(D, 2 * I)
    with torch.no_grad():
        for linear, w in zip((swiglu.gate_proj, swiglu.up_proj, swiglu.down_proj), shared):
            linear.weight.copy_(w)
        expected = fused_experts_ref(x, gate_up, down, weights, ids) + swiglu(x)
    actual = fused_experts_ref(x, gate_up, down, weights, ids, shared)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sparse_moe_fuses_its_shared_experts(backend):
    # SparseMoE hands its shared experts to the fused op; the tensor-parallel path adds them separately
    moe = SparseMoE(router_config(num_shared_experts=2))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    moe.experts.backends = BackendChoice(kernels=backend)
    x = torch.randn(5, D, generator=g)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        expected = fused_experts_ref(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids)
        expected = expected + moe.shared_experts(x)
        actual = moe(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
