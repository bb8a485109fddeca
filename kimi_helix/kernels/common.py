"""Argument checks shared by the kernels and their references (KDA, short conv): shapes, devices, varlen offsets.

Every check raises ``ValueError`` naming the offending argument. Only :func:`segment_bounds` reads ``cu_seqlens``
on the host (a device sync for a GPU tensor); the others look at shapes, dtypes and devices only.
"""

from __future__ import annotations

import torch

from kimi_helix.kernels.device import interpreting

__all__ = [
    "check_cu_seqlens",
    "check_device",
    "check_index",
    "check_shape",
    "check_triton_device",
    "gather_states",
    "scatter_states",
    "segment_bounds",
]


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], desc: str) -> None:
    """``t`` must have shape ``expected``; ``desc`` names its dims, e.g. ``"[B, T, H, K]"``."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {desc}={list(expected)}, got {list(t.shape)}")


def check_device(name: str, t: torch.Tensor, device: torch.device, ref: str = "q") -> None:
    """``t`` must be on ``device``, the device of the argument named ``ref``."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, {ref} on {device}")


def check_triton_device(name: str, t: torch.Tensor) -> None:
    """``t`` must be on CUDA, or on the CPU under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} is on {t.device}: the Triton kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)")


def check_index(name: str, t: torch.Tensor, numel: int, device: torch.device, ref: str = "q") -> None:
    """``t`` must be an int32/int64 vector of ``numel`` entries on ``device`` (e.g. ``state_indices [N]``)."""
    if t.dim() != 1 or t.numel() != numel or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 tensor of shape [{numel}], got {t.dtype} {list(t.shape)}")
    check_device(name, t, device, ref)


def check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, packed: str = "[1, total_T, ...]") -> int:
    """Checks of a packed input's ``cu_seqlens [N + 1]`` that need no device sync; returns N.

    ``packed`` is the packed input's layout for the message when ``B != 1``.
    """
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed input {packed}), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be an int32/int64 tensor of shape [N+1] with N >= 1, "
            f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
        )
    return cu_seqlens.numel() - 1


def segment_bounds(cu_seqlens: torch.Tensor | None, B: int, T: int, packed: str = "[1, total_T, ...]") -> list[int]:
    """Sequence boundaries ``[0, ..., B * T]`` as Python ints: ``B`` rows of ``T`` tokens, or the validated
    ``cu_seqlens`` of a packed ``B == 1`` input (read on the host)."""
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)]
    check_cu_seqlens(cu_seqlens, B, packed)
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(b > e for b, e in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {bounds}")
    return bounds


def gather_states(initial_state: torch.Tensor | None, state_indices: torch.Tensor | None) -> torch.Tensor | None:
    """The per-sequence states of a call: `initial_state` itself, or the rows `state_indices` of a state pool."""
    if state_indices is None:
        return initial_state
    if initial_state is None:
        raise ValueError("state_indices needs the state pool as initial_state")
    return initial_state[state_indices.long()]


def scatter_states(pool: torch.Tensor, state_indices: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """Write the final states back into their pool slots in place; return the pool (the kernels' contract)."""
    pool[state_indices.long()] = final.to(pool.dtype)
    return pool
