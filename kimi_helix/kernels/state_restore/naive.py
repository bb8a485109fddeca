"""Pure-PyTorch reference of the KDA rollback after a verify step, indexed by device counts.

A graphed verify step of n groups of G tokens leaves every KDA layer's per-token recurrent states and conv inputs
in the cache's verify scratch (group i's at rows i * G onwards, its conv state before the group at row i). After
group i keeps its anchor and a_i drafts, each layer's state for its sequence is the recurrent state after token
a_i and the conv window of the W - 1 inputs ending there. Reading a_i on the device (no host reads) lets a CUDA
graph restore the states before the host knows the counts. Given each group's rows (`scratch_at`), any subset of
a step's groups is restored in one call: the engine's synchronous rollback of the groups that rejected a draft.
"""

from __future__ import annotations

import torch

__all__ = ["check_restore_args", "restore_verified_states_ref"]


def check_restore_args(recurrent_pools, conv_pools, states, inputs, conv_before, slots, accepted, group,
                       scratch_at=None) -> None:  # fmt: skip
    """Shape and dtype checks shared by the reference and the Triton kernel (no device reads)."""
    if recurrent_pools.dim() != 5 or states.dim() != 5 or states.shape[2:] != recurrent_pools.shape[2:]:
        raise ValueError(
            f"recurrent_pools [L, S, H, K, V] and states [L, R, H, K, V] must agree, got "
            f"{list(recurrent_pools.shape)} and {list(states.shape)}"
        )
    layers = recurrent_pools.shape[0]
    if conv_pools.dim() != 4 or conv_pools.shape[0] != layers or conv_pools.shape[1] != recurrent_pools.shape[1]:
        raise ValueError(f"conv_pools must be [L={layers}, S, W-1, C], got {list(conv_pools.shape)}")
    width, channels = conv_pools.shape[2:]
    n = slots.shape[0]
    # with scratch_at the rows are on the device: the caller checks them against the scratch
    rows, seqs = (n * group, n) if scratch_at is None else (0, 0)
    if group < 1 or states.shape[0] != layers or states.shape[1] < rows:
        raise ValueError(f"states must be [L={layers}, R >= N * group={rows}, ...], got {list(states.shape)}")
    if inputs.shape[0] != layers or inputs.shape[1] < rows or inputs.shape[2] != channels:
        raise ValueError(f"inputs must be [L={layers}, R >= {rows}, C={channels}], got {list(inputs.shape)}")
    if conv_before.shape[0] != layers or conv_before.shape[1] < seqs or conv_before.shape[2:] != (width, channels):
        raise ValueError(f"conv_before must be [L={layers}, R >= {seqs}, {width}, {channels}], got "
                         f"{list(conv_before.shape)}")  # fmt: skip
    if scratch_at is not None and (scratch_at.dtype != torch.int64 or tuple(scratch_at.shape) != (n, 2)):
        raise ValueError(f"scratch_at must be int64 [N={n}, 2], got {scratch_at.dtype} {list(scratch_at.shape)}")
    conv_dtypes = {inputs.dtype, conv_before.dtype, conv_pools.dtype}
    if len(conv_dtypes) > 1 or states.dtype != recurrent_pools.dtype:
        raise ValueError("inputs and conv_before must have conv_pools' dtype, states recurrent_pools'")
    for name, t in (("slots", slots), ("accepted", accepted)):
        if t.dtype != torch.int64 or tuple(t.shape) != (n,):
            raise ValueError(f"{name} must be int64 [N={n}], got {t.dtype} {list(t.shape)}")


# Twin of kernels/state_restore/triton.py:restore_verified_states_triton (same signature and results): a change to
# one belongs in both.
@torch.no_grad()
def restore_verified_states_ref(
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
    """Cut every KDA layer's state of n verify groups back to after each group's first accepted + 1 tokens.

    Args:
        recurrent_pools: [L, S, H, K, V] the layers' recurrent states per slot, written at `slots`.
        conv_pools: [L, S, W - 1, C] the layers' conv states per slot, written at `slots`.
        states: [L, R, H, K, V] the verify scratch's state after each token (group i from row i * group).
        inputs: [L, R, C] the scratch's conv inputs, rows as `states`.
        conv_before: [L, R', W - 1, C] the scratch's conv state before each group (group i at row i).
        slots: [N] int64, each group's state slot. accepted: [N] int64, each group's kept drafts (0..group - 1).
        group: tokens a verify group (1 + k).
        scratch_at: [N, 2] int64, each group's first token's row in `states` and `inputs` and its row in
            `conv_before` (a `VerifyRecord.scratch_at` each), or None for groups i at rows i * group and i.
    """
    check_restore_args(recurrent_pools, conv_pools, states, inputs, conv_before, slots, accepted, group, scratch_at)
    n, dev = slots.shape[0], slots.device
    layers, _, width, channels = conv_pools.shape
    if scratch_at is None:
        scratch_at = torch.stack([torch.arange(0, n * group, group, device=dev), torch.arange(n, device=dev)], 1)
    first, seq = scratch_at.unbind(1)
    recurrent_pools.index_copy_(1, slots, states.index_select(1, first + accepted))
    # window row r is row j = accepted + 1 + r of [the conv state before the group; the group's inputs]
    j = accepted[:, None] + 1 + torch.arange(width, device=dev)  # [N, W - 1]
    index = j.clamp(max=width - 1)[None, :, :, None].expand(layers, n, width, channels)
    before = conv_before.index_select(1, seq).gather(2, index)
    group_rows = (first[:, None] + j - width).clamp(min=0)
    own = inputs.index_select(1, group_rows.flatten()).view(layers, n, width, channels)
    conv_pools.index_copy_(1, slots, torch.where((j < width)[None, :, :, None], before, own))
