"""Triton KDA rollback after a verify step: `restore_verified_states_ref`'s gathers, concatenation and scatters
in one launch.

Each program copies one block of one layer's state for one group: either a block of the recurrent state after the
group's last kept token, or a block of its conv window, whose rows come from the conv state before the group or
from the group's own inputs. The kept count is read on the device, so a CUDA graph holds the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import cdiv
from kimi_helix.kernels.state_restore.naive import check_restore_args

__all__ = ["CAPS", "restore_verified_states_triton"]

# What the kernel serves, read by the backend switch (chosen on the conv states' dtype; the recurrent states are
# copied in theirs).
CAPS = OpCaps(triton_devices(), FLOATS)
BLOCK = 1024  # elements a program copies


@triton.jit
def restore_kernel(
    rec_pools, conv_pools, states, inputs, conv_before, slots, accepted, scratch_at, N, G, STATE, WIDTH, C,
    REC_BLOCKS, s_rec_l, s_rec_s, s_conv_l, s_conv_s, s_conv_r, s_st_l, s_st_r, s_in_l, s_in_r, s_cb_l, s_cb_s,
    s_cb_r, s_acc, HAS_AT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    li = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    layer, i = li // N, li % N
    slot = tl.load(slots + i)
    a = tl.load(accepted + i * s_acc)
    if HAS_AT:  # the group's first row in states/inputs and its row in conv_before
        first, seq = tl.load(scratch_at + 2 * i), tl.load(scratch_at + 2 * i + 1)
    else:
        first, seq = i * G, i
    e = tl.arange(0, BLOCK)
    if b < REC_BLOCKS:  # the recurrent state after the group's last kept token (row first + a)
        o = b * BLOCK + e
        m = o < STATE
        x = tl.load(states + layer * s_st_l + (first + a) * s_st_r + o, mask=m)
        tl.store(rec_pools + layer * s_rec_l + slot * s_rec_s + o, x, mask=m)
    else:  # the conv window: row r is row a + 1 + r of [conv state before the group; the group's inputs]
        o = (b - REC_BLOCKS) * BLOCK + e
        m = o < WIDTH * C
        r, c = o // C, o % C
        j = a + 1 + r
        before = j < WIDTH
        x_before = tl.load(conv_before + layer * s_cb_l + seq * s_cb_s + j * s_cb_r + c, mask=m & before)
        x_group = tl.load(inputs + layer * s_in_l + (first + j - WIDTH) * s_in_r + c, mask=m & (j >= WIDTH))
        tl.store(conv_pools + layer * s_conv_l + slot * s_conv_s + r * s_conv_r + c,
                 tl.where(before, x_before, x_group), mask=m)  # fmt: skip


# Twin of kernels/state_restore/naive.py:restore_verified_states_ref (same signature and results): a change to one
# belongs in both.
@torch.no_grad()
def restore_verified_states_triton(
    recurrent_pools: torch.Tensor,
    conv_pools: torch.Tensor,
    states: torch.Tensor,
    inputs: torch.Tensor,
    conv_before: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    group: int,
    scratch_at: torch.Tensor | None = None,
) -> None:
    """Triton form of :func:`kimi_helix.kernels.state_restore.naive.restore_verified_states_ref`: the same
    arguments and writes (recurrent_pools [L, S, H, K, V], conv_pools [L, S, W - 1, C] at `slots` [N]) in one
    launch, no host sync. Each state row and conv row must be contiguous, and so must scratch_at [N, 2]."""
    check_restore_args(recurrent_pools, conv_pools, states, inputs, conv_before, slots, accepted, group, scratch_at)
    if scratch_at is not None and not scratch_at.is_contiguous():
        raise ValueError(f"scratch_at must be contiguous, got strides {scratch_at.stride()}")
    check_triton_device("conv_pools", conv_pools)
    for name, t in (("recurrent_pools", recurrent_pools), ("states", states)):
        if not t[0, 0].is_contiguous():
            raise ValueError(f"{name} must hold each [H, K, V] state contiguously, got strides {t.stride()}")
    for name, t in (("conv_pools", conv_pools), ("inputs", inputs), ("conv_before", conv_before)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    layers, n = conv_pools.shape[0], slots.shape[0]
    if n == 0 or layers == 0:
        return
    state, (width, channels) = recurrent_pools[0, 0].numel(), conv_pools.shape[2:]
    rec_blocks = cdiv(state, BLOCK)
    grid = (layers * n, rec_blocks + cdiv(width * channels, BLOCK))
    restore_kernel[grid](
        recurrent_pools, conv_pools, states, inputs, conv_before, slots, accepted,
        slots if scratch_at is None else scratch_at, n, group, state, width, channels, rec_blocks,
        *recurrent_pools.stride()[:2], *conv_pools.stride()[:3], *states.stride()[:2], *inputs.stride()[:2],
        *conv_before.stride()[:3], accepted.stride(0), HAS_AT=scratch_at is not None, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
