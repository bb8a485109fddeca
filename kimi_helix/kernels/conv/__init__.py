"""Short causal depthwise convolution ops (the KDA q/k/v ShortConvolution), dispatched by the backend switch.

`causal_conv1d` / `causal_conv1d_update` pick the torch reference (`naive.py`) or the Triton kernels
(`triton.py`) from their declared capabilities; see `naive.py` for the contracts.
"""

from __future__ import annotations

import torch

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.conv import naive


def _first(x):
    """The tensor the backend switch looks at: x itself, or its first channel group (see `naive.channel_groups`)."""
    return x if isinstance(x, torch.Tensor) else x[0]


def causal_conv1d(
    x,
    weight,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    activation="silu",
    state_indices=None,
    *,
    record_into=None,
    split_output=False,
    backend=None,
):
    """Causal depthwise conv + activation over x [B, T, D] or its channel groups (varlen with cu_seqlens); see
    `naive.causal_conv1d`. record_into: (conv_before [N, W-1, D], inputs [B*T, D]) buffers that also receive each
    sequence's state before the call and the raw inputs (a verify step's rollback records). split_output: y as one
    contiguous [B, T, D/S] tensor per channel group."""
    if op_backend("causal_conv1d", _first(x), forced=backend) == "triton":
        from kimi_helix.kernels.conv.triton import causal_conv1d_triton as fn
    else:
        fn = naive.causal_conv1d
    return fn(
        x, weight, initial_state, output_final_state, cu_seqlens, activation, state_indices,
        record_into=record_into, split_output=split_output,
    )  # fmt: skip


def causal_conv1d_update(x, conv_state, weight, activation="silu", state_indices=None, *, backend=None):
    """One decode step x [N, D] (or its channel groups, e.g. q, k, v) with conv_state [N, W-1, D] updated in place;
    see `naive.causal_conv1d_update`."""
    if op_backend("causal_conv1d_update", _first(x), forced=backend) == "triton":
        from kimi_helix.kernels.conv.triton import causal_conv1d_update_triton as fn
    else:
        fn = naive.causal_conv1d_update
    return fn(x, conv_state, weight, activation, state_indices)


__all__ = ["causal_conv1d", "causal_conv1d_update"]
