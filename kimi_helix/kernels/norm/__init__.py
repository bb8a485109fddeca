"""KDA's gated output RMSNorm: the torch reference, the Triton kernel and the dispatching `gated_rms_norm`."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.norm.naive import gated_rms_norm_ref


def gated_rms_norm(x, gate, weight, eps, *, backend=None):
    """`rmsnorm(x) * weight * sigmoid(gate)` over x, gate [..., D]; see `gated_rms_norm_ref`."""
    if op_backend("gated_rms_norm", x, forced=backend) == "triton":
        from kimi_helix.kernels.norm.triton import gated_rms_norm_triton

        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps)


def __getattr__(name):  # the Triton module imports triton; load it only when asked for
    if name == "gated_rms_norm_triton":
        from kimi_helix.kernels.norm.triton import gated_rms_norm_triton

        return gated_rms_norm_triton
    raise AttributeError(name)


__all__ = ["gated_rms_norm", "gated_rms_norm_ref", "gated_rms_norm_triton"]
