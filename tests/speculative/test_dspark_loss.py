"""DeepSpec's DSpark loss: the weights, the terms and the confidence target."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kimi_helix.speculative.dspark.loss import dspark_loss, position_weights


def test_position_weights_are_exp_minus_k_over_4():
    torch.testing.assert_close(position_weights(4), torch.tensor([math.exp(-k / 4) for k in range(4)]))


def test_loss_terms_match_a_direct_computation():
    torch.manual_seed(0)
    d, t = torch.randn(2, 3, 5, 11), torch.randn(2, 3, 5, 11)
    labels, conf = torch.randint(0, 11, (2, 3, 5)), torch.randn(2, 3, 5, requires_grad=True)
    out = dspark_loss(d, conf, labels, t)
    w = torch.tensor([math.exp(-k / 4) for k in range(5)])
    wmean = lambda x: (x * w).sum() / (w.sum() * 6)  # noqa: E731
    l1 = (d.softmax(-1) - t.softmax(-1)).abs().sum(-1)
    ce = F.cross_entropy(d.reshape(-1, 11), labels.reshape(-1), reduction="none").view(2, 3, 5)
    target = (1 - 0.5 * l1).clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(conf, target, reduction="none")
    torch.testing.assert_close(out.ce, wmean(ce))
    torch.testing.assert_close(out.l1, wmean(l1))
    torch.testing.assert_close(out.confidence, wmean(bce))
    torch.testing.assert_close(out.total, 0.1 * wmean(ce) + 0.9 * wmean(l1) + 1.0 * wmean(bce))
    out.total.backward()
    assert conf.grad is not None


def test_perfect_draft_has_zero_l1_and_full_acceptance():
    t = torch.randn(1, 4, 7)
    out = dspark_loss(t.clone(), torch.full((1, 4), 10.0), torch.zeros(1, 4, dtype=torch.long), t)
    assert out.l1.abs() < 1e-6 and torch.allclose(out.acceptance, torch.ones(4))
