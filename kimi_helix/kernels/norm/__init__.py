"""The norms: KDA's gated output RMSNorm (`gated_rms_norm`) and the pre-norm block's RMSNorm with the residual add
folded in (`add_rms_norm`). Each has a torch reference (`naive.py`), a Triton kernel (`triton.py`) and the
dispatching function here, which asks the op switch.

As separate torch ops, a pre-norm block's add and norm are an add plus about eight small kernels (cast, square, mean,
eps, rsqrt, two multiplies, cast); the Triton kernel does both in one pass over the row.
"""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.norm.naive import add_rms_norm_ref, gated_rms_norm_ref


def gated_rms_norm(x, gate, weight, eps, *, backend=None):
    """`rmsnorm(x) * weight * sigmoid(gate)` over x, gate [..., D]; see `gated_rms_norm_ref`."""
    if op_backend("gated_rms_norm", x, forced=backend) == "triton":
        from kimi_helix.kernels.norm.triton import gated_rms_norm_triton

        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps)


def add_rms_norm(x, residual, weight, eps, *, backend=None):
    """(weight * rmsnorm(x + residual), x + residual) over x, residual [..., D]; see `add_rms_norm_ref`."""
    if op_backend("add_rms_norm", x, forced=backend) == "triton":
        from kimi_helix.kernels.norm.triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def __getattr__(name):  # the Triton module imports triton; load it only when asked for
    if name in ("add_rms_norm_triton", "gated_rms_norm_triton"):
        from kimi_helix.kernels.norm import triton

        return getattr(triton, name)
    raise AttributeError(name)


__all__ = [
    "add_rms_norm",
    "add_rms_norm_ref",
    "add_rms_norm_triton",
    "gated_rms_norm",
    "gated_rms_norm_ref",
    "gated_rms_norm_triton",
]
