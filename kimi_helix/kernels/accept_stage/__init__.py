"""Greedy acceptance of n verify groups and the staging of the next verify step, on the device (an asynchronous
DSpark round's bookkeeping), dispatched by the op switch."""

from __future__ import annotations

from kimi_helix.kernels.accept_stage.naive import accept_and_stage_ref
from kimi_helix.kernels.backends import op_backend


def accept_and_stage(argmax, draft_inputs, input_ids, positions, slot_mapping, cache_seqlens, block_table, result,
                     write_at, page_size, *, backend=None) -> None:  # fmt: skip
    """argmax [N, G] int64 -> in place: draft_inputs [3, N] advanced, the next step's input_ids (anchors),
    positions, slot_mapping [N * G] and cache_seqlens [N], result [N, G + 1] and write_at [2, N * G]; see
    `accept_and_stage_ref`. The backend is chosen on argmax (int64)."""
    if op_backend("accept_and_stage", argmax, forced=backend) == "triton":
        from kimi_helix.kernels.accept_stage.triton import accept_and_stage_triton as fn
    else:
        fn = accept_and_stage_ref
    fn(argmax, draft_inputs, input_ids, positions, slot_mapping, cache_seqlens, block_table, result, write_at,
       page_size)  # fmt: skip


__all__ = ["accept_and_stage", "accept_and_stage_ref"]
