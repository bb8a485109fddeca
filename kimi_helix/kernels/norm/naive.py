"""Pure-PyTorch references of the norms: KDA's gated output norm (fla ``FusedRMSNormGated`` with a sigmoid gate)
and the pre-norm block's RMSNorm with the residual add folded in."""

from __future__ import annotations

import torch

__all__ = ["add_rms_norm_ref", "gated_rms_norm_ref"]


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dim, all in fp32 (`modeling.layers.GatedRMSNorm`).

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


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = x + residual` (rounded to x.dtype), then `y = weight * rmsnorm(h)` as `modeling.layers.RMSNorm` does.

    The norm runs in fp32 and is cast back to x.dtype before the weight multiply (Kimi-Linear's order).

    Args:
        x: [..., D] sublayer output (or the only input when residual is None).
        residual: [..., D] the residual stream in x.dtype, or None for a plain RMSNorm of x.
        weight: [D].
        eps: added to the mean square inside the rsqrt.

    Returns:
        (y [..., D] in the promoted dtype of weight and x, h [..., D] in x.dtype: the new residual stream; x
        itself when residual is None).
    """
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), h
