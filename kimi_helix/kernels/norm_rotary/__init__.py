"""Per-head RMSNorm then RoPE in one pass (`norm_rotary`), and the same on the drafter's context keys written with
their values into its context cache (`norm_rotary_into_cache`), dispatched by the op switch.

Unfused, the DSpark drafter ran a norm and a rotary kernel for q and again for k in every layer of a draft, and a
norm, a rotary and two scatters for the context rows of every layer: ten launches a layer become two."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.norm_rotary.naive import norm_rotary_into_cache_ref, norm_rotary_ref


def norm_rotary(x, positions, weights, eps, theta, *, backend=None):
    """x [N, H, D], positions [N], one or two norm weights [D] -> [N, H, D]; see `norm_rotary_ref`."""
    if op_backend("norm_rotary", x, forced=backend) == "triton":
        from kimi_helix.kernels.norm_rotary.triton import norm_rotary_triton as fn
    else:
        fn = norm_rotary_ref
    return fn(x, positions, weights, eps, theta)


def norm_rotary_into_cache(k, v, positions, weight, eps, theta, k_cache, v_cache, slots, *, backend=None) -> None:
    """k, v [T, H, D] -> k_cache, v_cache [S, C, H, D] at (slots, positions), k normed and rotated; see
    `norm_rotary_into_cache_ref`."""
    if op_backend("norm_rotary_into_cache", k, forced=backend) == "triton":
        from kimi_helix.kernels.norm_rotary.triton import norm_rotary_into_cache_triton as fn
    else:
        fn = norm_rotary_into_cache_ref
    fn(k, v, positions, weight, eps, theta, k_cache, v_cache, slots)


__all__ = ["norm_rotary", "norm_rotary_into_cache", "norm_rotary_into_cache_ref", "norm_rotary_ref"]
