"""Mixture-of-experts ops: sigmoid top-k routing and the fused routed plus shared experts (dispatched by the switch)."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.moe.naive import SharedExperts, fused_experts_ref, moe_router_ref


def fused_experts(x, gate_up_proj, down_proj, weights, ids, shared=None, residual=None, *, backend=None):
    """Routed experts: x [T, d], gate_up_proj [E, 2I, d], down_proj [E, d, I], weights/ids [T, k] -> [T, d];
    plus the shared experts `shared` (`SharedExperts`: gate, up [I_s, d], down [d, I_s]) at weight 1 and the
    residual [T, d] when given."""
    if op_backend("fused_experts", x, forced=backend) == "triton":
        from kimi_helix.kernels.moe.triton import fused_experts_triton

        return fused_experts_triton(x, gate_up_proj, down_proj, weights, ids, shared, residual)
    return fused_experts_ref(x, gate_up_proj, down_proj, weights, ids, shared, residual)


__all__ = ["SharedExperts", "fused_experts", "fused_experts_ref", "moe_router_ref"]
