"""Pure-PyTorch reference of the SwiGLU activation `silu(gate) * up`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["silu_mul_ref"]


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` as two torch ops (each rounds to the inputs' dtype, as `SwiGLU` computed it).

    Args:
        gate, up: [..., I] of one dtype.

    Returns:
        [..., I] in that dtype.
    """
    return F.silu(gate) * up
