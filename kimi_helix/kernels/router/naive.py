"""Pure-PyTorch reference of the MoE router: the contract lives with the MoE references (`moe.naive`)."""

from __future__ import annotations

from kimi_helix.kernels.moe.naive import moe_router_ref

__all__ = ["moe_router_ref"]
