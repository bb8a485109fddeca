"""Pure-PyTorch reference for KDA's gated output norm (fla ``FusedRMSNormGated`` with a sigmoid gate)."""

from __future__ import annotations

import torch

__all__ = ["gated_rms_norm_ref"]


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dim, all in fp32 (as ``modeling.layers.gated_rms_norm``).

    Args:
        x: ``[..., D]`` per-head attention output.
        gate: ``[..., D]`` gate pre-activation.
        weight: ``[D]``.
        eps: added to the mean square inside the rsqrt.

    Returns:
        ``[..., D]`` in x.dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)
