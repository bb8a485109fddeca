"""MoE routing: the bias steers selection only; weights are renormalised unbiased scores times the scaling."""

import torch

from kimi_helix import KimiK3Config
from kimi_helix.modeling.moe import SparseMoE, TopkRouter

from .conftest import rel_err, tiny_kwargs


def make_router(**overrides) -> TopkRouter:
    router = TopkRouter(KimiK3Config(**tiny_kwargs(**overrides)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.1)
    return router


def test_bias_changes_selection_not_weights():
    router = make_router(routed_scaling_factor=2.5)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[7] = 10.0  # expert 7 always chosen
        weights, ids = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    assert (ids == 7).any(dim=1).all()
    expected = scores.gather(1, ids)
    expected = expected / expected.sum(1, keepdim=True) * 2.5
    assert rel_err(weights, expected) < 1e-6
    # The rest of the choice is the best unbiased score among the other experts.
    other = ids[ids != 7].view(16, -1)
    masked = scores.clone()
    masked[:, 7] = -1
    assert torch.equal(other.sort(1).values, masked.topk(1, dim=1).indices.sort(1).values)


def test_grouped_topk_only_picks_from_best_groups():
    router = make_router(num_experts=8, num_expert_group=4, topk_group=2, num_experts_per_token=3)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, ids = router(x)
    scores = torch.sigmoid(x @ router.weight.T).view(32, 4, 2)
    best_groups = scores.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    assert all(set((ids[t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(32))


def test_sparse_moe_equals_per_token_sum():
    moe = SparseMoE(KimiK3Config(**tiny_kwargs()))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(10, 64, generator=g)
    with torch.no_grad():
        out = moe(x)
        weights, ids = moe.gate(x)
        expected = moe.shared_experts(x)
        for t in range(10):
            for w, e in zip(weights[t], ids[t]):
                gate, up = (moe.experts.gate_up_proj[e] @ x[t]).chunk(2)
                expected[t] += w * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    assert rel_err(out, expected) < 1e-5
