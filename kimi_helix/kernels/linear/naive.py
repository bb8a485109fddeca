"""Pure-PyTorch reference of `linear`: one activation against one or several weights, outputs side by side."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["linear_ref"]


def linear_ref(x: torch.Tensor, weights: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """`x W^T` for each weight, concatenated along the last dim (one weight: plain `F.linear`, no bias).

    Args:
        x: [..., K].
        weights: one [N, K] weight, or several [N_i, K] weights of x's dtype (the projections that read the same x,
            e.g. a layer's q, k and v).

    Returns:
        [..., N] or [..., sum N_i] in x's dtype.
    """
    if isinstance(weights, torch.Tensor):
        return F.linear(x, weights)
    return torch.cat([F.linear(x, w) for w in weights], dim=-1)
