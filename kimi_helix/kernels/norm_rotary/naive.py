"""Pure-PyTorch references of per-head RMSNorm followed by RoPE (the DSpark drafter's q/k norm and rotary), and of
the same on the keys of the drafter's context rows, written with their values into its context cache.

Each is the composition it replaces, op for op: `add_rms_norm_ref` without residual (`RMSNorm`) then `rotary_ref`,
so the fused kernels are held to the unfused path's roundings (the norm's output is rounded to x's dtype before the
rotation reads it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kimi_helix.kernels.common import check_device, check_index, check_shape
from kimi_helix.kernels.norm.naive import add_rms_norm_ref
from kimi_helix.kernels.rotary.naive import rotary_ref

__all__ = [
    "check_into_cache_args",
    "check_norm_rotary_args",
    "norm_rotary_into_cache_ref",
    "norm_rotary_ref",
    "weight_list",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_WEIGHTS = 2  # q's and k's norms, side by side in one projection


def weight_list(weights: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One [D] weight, or a sequence of them, as a list."""
    return [weights] if isinstance(weights, torch.Tensor) else list(weights)


def check_norm_rotary_args(x: torch.Tensor, positions: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """Shape, dtype and device checks shared by the references and the Triton kernel (no device reads)."""
    if x.dim() != 3 or x.dtype not in _DTYPES or x.shape[-1] % 2:
        raise ValueError(f"x must be a fp32/fp16/bf16 tensor [N, H, D] with D even, got {x.dtype} {list(x.shape)}")
    n, h, d = x.shape
    if not 1 <= len(weights) <= MAX_WEIGHTS or h % len(weights):
        raise ValueError(f"weights must be 1..{MAX_WEIGHTS} norm weights dividing H={h} heads, got {len(weights)}")
    for i, w in enumerate(weights):
        check_shape(f"weights[{i}]", w, (d,), "[D]")
        if w.dtype != x.dtype:
            raise ValueError(f"weights[{i}] must have x's dtype {x.dtype}, got {w.dtype}")
        check_device(f"weights[{i}]", w, x.device, "x")
    if positions.shape != (n,) or positions.is_floating_point():
        raise ValueError(
            f"positions must be an integer tensor [N]=[{n}], got {positions.dtype} {list(positions.shape)}"
        )
    check_device("positions", positions, x.device, "x")


def check_into_cache_args(k, v, positions, weight, k_cache, v_cache, slots) -> None:
    """`norm_rotary_into_cache`'s checks, shared by the reference and the Triton kernel (no device reads: the slots
    and positions are not checked against the cache's size)."""
    check_norm_rotary_args(k, positions, [weight])
    check_shape("v", v, k.shape, "[T, H, D]")
    t, h, d = k.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[2:] != (h, d) or cache.dtype != k.dtype:
            raise ValueError(
                f"{name} must be a {k.dtype} tensor [S, C, H={h}, D={d}], got {cache.dtype} {list(cache.shape)}"
            )
        check_device(name, cache, k.device, "k")
    if v.dtype != k.dtype:
        raise ValueError(f"v must have k's dtype {k.dtype}, got {v.dtype}")
    check_device("v", v, k.device, "k")
    check_index("slots", slots, t, k.device, "k")


def norm_rotary_ref(
    x: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | Sequence[torch.Tensor], eps: float, theta: float
) -> torch.Tensor:
    """RMSNorm of every head (fp32, rounded to x's dtype, times its weight), then RoPE by position (rotate-half).

    Args:
        x: [N, H, D] fp32/fp16/bf16, D even (any strides: e.g. the q and k heads of a packed projection).
        positions: [N] integer positions.
        weights: one norm weight [D] for all heads, or S weights [D], weight s serving heads [s * H / S, (s + 1) *
            H / S) (q's norm for the first half, k's for the second), each in x's dtype.
        eps: added to the mean square inside the rsqrt.
        theta: the rotary base.

    Returns:
        [N, H, D] contiguous in x.dtype.
    """
    weights = weight_list(weights)
    check_norm_rotary_args(x, positions, weights)
    groups = x.chunk(len(weights), dim=1)
    normed = torch.cat([add_rms_norm_ref(g, None, w, eps)[0] for g, w in zip(groups, weights)], dim=1)
    return rotary_ref(normed, positions, theta)


def norm_rotary_into_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    theta: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Context rows into a per-slot cache: `k_cache[slots[t], positions[t]] = norm_rotary_ref(k, positions, weight)[t]`
    and `v_cache[slots[t], positions[t]] = v[t]`, in place.

    Args:
        k, v: [T, H, D] (any strides), v in k's dtype.
        positions, slots: [T] integer (the row and the slot of each token; (slot, position) pairs distinct).
        weight: [D] the keys' norm weight; eps, theta as `norm_rotary_ref`.
        k_cache, v_cache: [S, C, H, D] in k's dtype, written at the listed rows only.
    """
    check_into_cache_args(k, v, positions, weight, k_cache, v_cache, slots)
    k_cache.index_put_((slots, positions), norm_rotary_ref(k, positions, weight, eps, theta))
    v_cache.index_put_((slots, positions), v)
