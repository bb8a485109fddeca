"""MoE routing (sigmoid/softmax top-k with a selection bias and group limits), dispatched by the op switch."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.router.naive import moe_router_ref


def moe_router(x, weight, bias, top_k, num_groups=1, topk_group=1, renormalize=True, scaling=1.0,
               activation="sigmoid", *, backend=None):  # fmt: skip
    """x [T, d] -> (weights [T, top_k] fp32, ids [T, top_k] int64); see `moe_router_ref`."""
    if op_backend("moe_router", x, forced=backend) == "triton":
        from kimi_helix.kernels.router.triton import moe_router_triton as fn
    else:
        fn = moe_router_ref
    return fn(x, weight, bias, top_k, num_groups, topk_group, renormalize, scaling, activation)


__all__ = ["moe_router", "moe_router_ref"]
