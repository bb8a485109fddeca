"""RMSNorm with the residual add folded in: the torch reference and the dispatching `add_rms_norm`.

A pre-norm block adds a sublayer's output to the residual stream and normalises the sum for the next sublayer. As
separate torch ops that is an add plus about eight small kernels (cast, square, mean, eps, rsqrt, two multiplies,
cast); the Triton kernel (`add_rms_norm_triton`) does both in one pass over the row.
"""

from __future__ import annotations

import torch

from kimi_helix.kernels.backends import op_backend

__all__ = ["add_rms_norm", "add_rms_norm_ref"]


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


def add_rms_norm(x, residual, weight, eps, *, backend=None):
    """Dispatch `add_rms_norm_ref`'s contract to the Triton kernel or the reference (the op switch)."""
    if op_backend("add_rms_norm", x, forced=backend) == "triton":
        from kimi_helix.kernels.norm.add_rms_norm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
