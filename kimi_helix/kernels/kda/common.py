"""Argument checks of the KDA references and Triton kernels: the q/k/v/g/beta shapes, the in-kernel gate and the
recurrent state. The generic checks (shapes, devices, varlen offsets) are in `kernels/common.py`."""

from __future__ import annotations

import torch

from kimi_helix.kernels.common import check_device, check_shape

__all__ = ["check_gate_args", "check_intermediate_states", "check_kda_inputs", "check_state"]


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


def check_intermediate_states(
    buf: torch.Tensor | None, wanted: bool, tokens: int, H: int, K: int, V: int, device: torch.device
) -> None:
    """The caller's buffer for the per-token states: a contiguous fp32 ``[tokens, H, K, V]`` on ``device``, given
    only with ``return_intermediate_states`` (it is where they go)."""
    if buf is None:
        return
    if not wanted:
        raise ValueError("intermediate_states is the buffer of return_intermediate_states=True: pass both or neither")
    check_shape("intermediate_states", buf, (tokens, H, K, V), "[B * T, H, K, V]")
    if buf.dtype != torch.float32 or not buf.is_contiguous():
        raise ValueError(f"intermediate_states must be a contiguous fp32 tensor, got {buf.dtype}")
    check_device("intermediate_states", buf, device)
