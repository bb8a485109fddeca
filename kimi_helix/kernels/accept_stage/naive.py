"""Pure-PyTorch reference of greedy acceptance and next-step staging for n verify groups, on the device.

A verify step ran n groups of G = 1 + k tokens each: an anchor and k drafts. Its argmax rows say how many drafts
each group keeps (the leading drafts equal to the target's argmax at the row before them), and from that count alone
the next verify step is laid out: the next anchor (the argmax after the last kept token) at the position after it,
its k draft slots after that, their cache slots read from the block table, and each sequence's cached length after
the step. The drafter's context write of the verified tokens needs their (slot, position) pairs, and the host needs
the argmax rows and the counts; both are written here too. Everything is a tensor write (no host reads), so a CUDA
graph can hold it.
"""

from __future__ import annotations

import torch

__all__ = ["accept_and_stage_ref", "check_accept_stage_args"]


def check_accept_stage_args(argmax, draft_inputs, input_ids, positions, slot_mapping, cache_seqlens, block_table,
                            result, write_at, page_size) -> None:  # fmt: skip
    """Shape and dtype checks shared by the reference and the Triton kernel (no device reads)."""
    if argmax.dim() != 2 or argmax.dtype != torch.int64 or argmax.shape[1] < 2:
        raise ValueError(f"argmax must be int64 [N, G] with G >= 2, got {argmax.dtype} {list(argmax.shape)}")
    n, g = argmax.shape
    int64 = {"draft_inputs": (draft_inputs, (3, n)), "input_ids": (input_ids, (n * g,)),
             "positions": (positions, (n * g,)), "slot_mapping": (slot_mapping, (n * g,)),
             "result": (result, (n, g + 1)), "write_at": (write_at, (2, n * g))}  # fmt: skip
    int32 = {"cache_seqlens": (cache_seqlens, (n,))}
    for dtype, fields in ((torch.int64, int64), (torch.int32, int32)):
        for name, (t, shape) in fields.items():
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if block_table.dim() != 2 or block_table.shape[0] != n or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [N={n}, W], got {block_table.dtype} {list(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dim, got strides {block_table.stride()}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")


# Twin of kernels/accept_stage/triton.py:accept_and_stage_triton (same signature and results): a change to one
# belongs in both.
@torch.no_grad()
def accept_and_stage_ref(
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
    """Accept greedily from n verify groups of G tokens and stage the next verify step in place.

    Args:
        argmax: [N, G] int64, the target's argmax at each verified token.
        draft_inputs: [3, N] int64 (anchor ids, anchor positions, drafter slots), read and advanced in place: the
            next anchor argmax[i, a_i] at position p_i + a_i + 1, where a_i counts group i's kept drafts.
        input_ids: [N * G] int64, the verified step's tokens (group i: its anchor, then its drafts), read; the next
            anchors are written at each group's first token (the drafts are the caller's to write).
        positions, slot_mapping: [N * G] int64, written: the next step's positions (anchor position + 0..G-1) and
            flat cache slots (block_table[i, pos // page_size] * page_size + pos % page_size; a position past
            the table reads its last page, as no step of that length may run).
        cache_seqlens: [N] int32, written: each sequence's cached tokens after the next step.
        block_table: [N, W] int32, the sequences' pages (mapped ahead by the host).
        result: [N, G + 1] int64, written: the argmax rows, then a_i.
        write_at: [2, N * G] int64, written: the drafter slot and position of every verified token, for the
            drafter's context write.
        page_size: tokens a page.
    """
    check_accept_stage_args(argmax, draft_inputs, input_ids, positions, slot_mapping, cache_seqlens, block_table,
                            result, write_at, page_size)  # fmt: skip
    n, g = argmax.shape
    ids = input_ids.view(n, g)
    anchors, anchor_pos, slots = draft_inputs
    accepted = (argmax[:, :-1] == ids[:, 1:]).cumprod(dim=1).sum(dim=1)
    result[:, :g].copy_(argmax)
    result[:, g].copy_(accepted)
    offsets = torch.arange(g, device=argmax.device)
    write_at[0].view(n, g).copy_(slots[:, None].expand(n, g))
    write_at[1].view(n, g).copy_(anchor_pos[:, None] + offsets)
    anchors.copy_(argmax.gather(1, accepted[:, None])[:, 0])
    anchor_pos.add_(accepted + 1)
    ids[:, 0].copy_(anchors)
    pos = positions.view(n, g)
    torch.add(anchor_pos[:, None], offsets, out=pos)
    index = pos.div(page_size, rounding_mode="floor").clamp_(max=block_table.shape[1] - 1)
    pages = block_table.gather(1, index).to(torch.int64)
    torch.add(pos.remainder(page_size), pages, alpha=page_size, out=slot_mapping.view(n, g))
    cache_seqlens.copy_(anchor_pos + g)
