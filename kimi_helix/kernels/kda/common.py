"""Argument checks shared by the KDA references and Triton kernels, and by the short conv (same varlen contract).

Every check raises ``ValueError`` naming the offending argument. Only :func:`segment_bounds` reads ``cu_seqlens``
on the host (a device sync for a GPU tensor); the others look at shapes, dtypes and devices only.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "check_cu_seqlens",
    "check_device",
    "check_gate_args",
    "check_index",
    "check_kda_inputs",
    "check_shape",
    "check_state",
    "check_triton_device",
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
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
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


def check_kda_inputs(q, k, v, g, beta) -> tuple[int, int, int, int, int]:
    """Shapes of q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]`` and beta ``[B, T, H]``; returns (B, T, H, K, V)."""
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {list(q.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4:
        raise ValueError(f"v must have shape [B, T, H, V], got {list(v.shape)}")
    V = v.shape[-1]
    check_shape("k", k, (B, T, H, K), "[B, T, H, K]")
    check_shape("v", v, (B, T, H, V), "[B, T, H, V]")
    check_shape("g", g, (B, T, H, K), "[B, T, H, K]")
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    return B, T, H, K, V


def check_gate_args(
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None, H: int, K: int
) -> None:
    """The in-kernel gate: ``A_log`` (H elements) and ``dt_bias`` (H * K) together or neither; ``lower_bound``
    negative and only with them."""
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias must be given together (the in-kernel gate needs both) or both omitted")
    if lower_bound is not None:
        if A_log is None:
            raise ValueError("lower_bound applies to the in-kernel gate only: pass A_log and dt_bias")
        if not lower_bound < 0:
            raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    if A_log is not None and (A_log.numel() != H or dt_bias.numel() != H * K):
        raise ValueError(f"A_log needs H={H} elements and dt_bias H*K={H * K}, got {A_log.numel()}, {dt_bias.numel()}")


def check_state(
    initial_state: torch.Tensor | None,
    state_indices: torch.Tensor | None,
    N: int,
    H: int,
    K: int,
    V: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The recurrent state argument of the Triton kernels; returns it ready for them.

    With ``state_indices`` it is the pool ``[slots, H, K, V]``, a contiguous fp32 tensor updated in place;
    otherwise ``[N, H, K, V]`` or None (returned contiguous). ``state_indices`` itself is the caller's to check.
    """
    if state_indices is not None:
        if initial_state is None:
            raise ValueError("state_indices needs initial_state (the state pool [slots, H, K, V])")
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (H, K, V):
            raise ValueError(
                f"initial_state (the state pool) must have shape [slots, H, K, V]=[slots, {H}, {K}, {V}], "
                f"got {list(initial_state.shape)}"
            )
        if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError("the state pool must be a contiguous fp32 tensor (it is updated in place)")
    elif initial_state is not None:
        check_shape("initial_state", initial_state, (N, H, K, V), "[N, H, K, V]")
        initial_state = initial_state.contiguous()
    if initial_state is not None:
        check_device("initial_state", initial_state, device)
    return initial_state


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
