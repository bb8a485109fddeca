"""Triton greedy acceptance and next-step staging: `accept_and_stage_ref`'s two dozen small launches in one.

Between two verify steps of an asynchronous DSpark round the device must accept, advance the drafter's inputs and
lay out the next step before the host has looked at anything. In torch that is about 20 kernels of a few elements
each: at batch 1 a round of the demo model spends more GPU time launching them than computing. Here one program
handles one verify group: it compares the group's drafts with the argmax row, finds the first miss, and writes every
output of its group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.accept_stage.naive import check_accept_stage_args
from kimi_helix.kernels.backends import INDICES, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import next_pow2

__all__ = ["CAPS", "accept_and_stage_triton"]

# What the kernel serves, read by the backend switch: int64 token ids and positions.
CAPS = OpCaps(triton_devices(), INDICES)


@triton.jit
def accept_stage_kernel(
    argmax, inputs, ids, positions, slot_mapping, seqlens, table, result, write_at, N, G, W, PAGE,
    stride_am, stride_in, stride_table, stride_res, stride_write, BLOCK_G: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK_G)
    in_g = o < G
    am = tl.load(argmax + i * stride_am + o, mask=in_g, other=0)
    drafts = tl.load(ids + i * G + 1 + o, mask=o < G - 1, other=0)
    miss = (am != drafts) & (o < G - 1)
    accepted = tl.min(tl.where(miss, o, G - 1), axis=0).to(tl.int64)  # the kept drafts: those before the first miss
    anchor = tl.sum(tl.where(o == accepted, am, 0), axis=0)
    p = tl.load(inputs + stride_in + i)
    slot = tl.load(inputs + 2 * stride_in + i)
    tl.store(result + i * stride_res + o, am, mask=in_g)
    tl.store(result + i * stride_res + G, accepted)
    tl.store(write_at + i * G + o, tl.zeros_like(o).to(tl.int64) + slot, mask=in_g)
    tl.store(write_at + stride_write + i * G + o, p + o, mask=in_g)
    new = p + accepted + 1
    tl.store(inputs + i, anchor)
    tl.store(inputs + stride_in + i, new)
    tl.store(ids + i * G, anchor)
    pos = new + o
    tl.store(positions + i * G + o, pos, mask=in_g)
    page = tl.load(table + i * stride_table + tl.minimum(pos // PAGE, W - 1), mask=in_g, other=0).to(tl.int64)
    tl.store(slot_mapping + i * G + o, page * PAGE + pos % PAGE, mask=in_g)
    tl.store(seqlens + i, (new + G).to(tl.int32))


# Twin of kernels/accept_stage/naive.py:accept_and_stage_ref (same signature and results): a change to one belongs in
# both.
@torch.no_grad()
def accept_and_stage_triton(
    argmax: torch.Tensor,
    draft_inputs: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    result: torch.Tensor,
    write_at: torch.Tensor,
    page_size: int,
) -> None:
    """Triton form of :func:`kimi_helix.kernels.accept_stage.naive.accept_and_stage_ref`: the same arguments and
    writes (argmax [N, G], draft_inputs [3, N], input_ids/positions/slot_mapping [N * G], cache_seqlens [N],
    block_table [N, W], result [N, G + 1], write_at [2, N * G]) in one launch of N programs, no host sync."""
    check_accept_stage_args(argmax, draft_inputs, input_ids, positions, slot_mapping, cache_seqlens, block_table,
                            result, write_at, page_size)  # fmt: skip
    check_triton_device("argmax", argmax)
    n, g = argmax.shape
    if n == 0:
        return
    accept_stage_kernel[(n,)](
        argmax, draft_inputs, input_ids, positions, slot_mapping, cache_seqlens, block_table, result, write_at,
        n, g, block_table.shape[1], page_size, argmax.stride(0), draft_inputs.stride(0), block_table.stride(0),
        result.stride(0), write_at.stride(0), BLOCK_G=next_pow2(g), num_warps=1,
    )  # fmt: skip
