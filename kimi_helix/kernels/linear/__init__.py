"""`linear`: an activation times one or several weights (no bias): the torch reference, the Triton kernel for few
rows, and the dispatching `linear`."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.linear.naive import linear_ref


def linear(x, weights, *, backend=None):
    """`x W_i^T` for each weight, side by side: x [..., K], weights [N, K] or a sequence of [N_i, K] ->
    [..., sum N_i]; see `linear_ref`. The Triton kernel serves calls of at most 16 rows (decode steps)."""
    if op_backend("linear", x, forced=backend, rows=x.numel() // max(x.shape[-1], 1)) == "triton":
        from kimi_helix.kernels.linear.triton import linear_triton

        return linear_triton(x, weights)
    return linear_ref(x, weights)


__all__ = ["linear", "linear_ref"]
