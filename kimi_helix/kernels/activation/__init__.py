"""The SwiGLU activation `silu(gate) * up`: the torch reference, the Triton kernel and the dispatching `silu_mul`."""

from __future__ import annotations

from kimi_helix.kernels.activation.naive import silu_mul_ref
from kimi_helix.kernels.backends import op_backend


def silu_mul(gate, up, *, backend=None):
    """`silu(gate) * up` over [..., I]; see `silu_mul_ref`."""
    if op_backend("silu_mul", gate, forced=backend) == "triton":
        from kimi_helix.kernels.activation.triton import silu_mul_triton

        return silu_mul_triton(gate, up)
    return silu_mul_ref(gate, up)


__all__ = ["silu_mul", "silu_mul_ref"]
