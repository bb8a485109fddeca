"""DeepSpec's DSpark distillation loss: `0.1 * CE + 0.9 * L1 + 1.0 * BCE(confidence, 1 - 0.5 * ||p_d - p_t||_1)`.

Every term is a mean over slots weighted by `exp(-k / 4)` (slot k = 0..gamma-1), which favours early slots, the
ones every accepted prefix needs. CE is against the target-generated tokens; L1 is the full `||p_d - p_t||_1`
between the drafter's Markov-corrected teacher-forced distribution and the target's at the same position; the
confidence head is trained towards the analytic acceptance `1 - 0.5 * ||p_d - p_t||_1` (detached, in [0, 1]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CE_WEIGHT, L1_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
POSITION_DECAY = 4.0


@dataclass
class DSparkLoss:
    """The total and its terms (scalars); `acceptance` [gamma] is the mean analytic acceptance per slot."""

    total: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    confidence: torch.Tensor
    acceptance: torch.Tensor


def position_weights(block_size: int, device=None) -> torch.Tensor:
    """[gamma]: exp(-k / 4) for k = 0..gamma-1."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / POSITION_DECAY)


def dspark_loss(
    draft_logits: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    labels: torch.Tensor,
    target_logits: torch.Tensor,
) -> DSparkLoss:
    """draft_logits, target_logits [..., G, V] (aligned: both predict the same token); labels [..., G];
    confidence_logits [..., G] or None (then the confidence term is 0)."""
    g = draft_logits.shape[-2]
    w = position_weights(g, draft_logits.device).expand(labels.shape)
    den = w.sum()
    ce = (F.cross_entropy(draft_logits.flatten(0, -2).float(), labels.flatten(), reduction="none") * w.flatten()).sum()
    p_d = torch.softmax(draft_logits.float(), dim=-1)
    p_t = torch.softmax(target_logits.float(), dim=-1)
    l1_dist = (p_d - p_t).abs().sum(dim=-1)
    l1 = (l1_dist * w).sum()
    acceptance = (1.0 - 0.5 * l1_dist).detach().clamp(0.0, 1.0)
    conf = torch.zeros((), device=draft_logits.device)
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), acceptance, reduction="none")
        conf = (bce * w).sum() / den
    ce, l1 = ce / den, l1 / den
    total = CE_WEIGHT * ce + L1_WEIGHT * l1 + CONFIDENCE_WEIGHT * conf
    return DSparkLoss(total, ce, l1, conf, acceptance.flatten(0, -2).mean(0))
