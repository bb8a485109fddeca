"""Rotary position embedding: the torch reference, the Triton kernel and the dispatching `rotary`."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.rotary.naive import inv_freq, rotary_ref


def rotary(x, positions, theta, *, backend=None):
    """Rotate the last dim of x [N, ..., D] by positions [N]; see `rotary_ref`."""
    if op_backend("rotary", x, forced=backend) == "triton":
        from kimi_helix.kernels.rotary.triton import rotary_triton

        return rotary_triton(x, positions, theta)
    return rotary_ref(x, positions, theta)


__all__ = ["inv_freq", "rotary", "rotary_ref"]
