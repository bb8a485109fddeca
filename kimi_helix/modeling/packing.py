"""Packed weights: several projections' weights become views of one tensor, so one `linear` launch serves them.

`WeightPack` packs on the first call that can use it and keeps the parameters as they were: the same Parameter
objects and names, their data now blocks of the packed tensor, so in-place updates (loading, optimisers) reach it
and the memory is unchanged (a block-diagonal pack adds its zero blocks). Two layouts:

- rows: [sum N_i, K], every projection reads the same x [..., K];
- diagonal: [sum N_i, sum K_i], block diagonal, zero elsewhere; projection i reads columns
  [sum K_<i, sum K_<=i) of x [..., sum K_i] (two low-rank gates whose inputs lie side by side, say).
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import plain_linear

# Devices on which projections run over a packed weight: the packing only saves launches, and safetensors refuses
# to save CPU tensors that share storage.
PACK_DEVICES = ("cuda",)
MAX_PACKINGS = 2  # the first, and one after a conversion (`model.to(...)`) replaced the weights


def _blocks(ws: list[torch.Tensor], diagonal: bool) -> list[tuple[slice, slice]]:
    """Where each of `ws` sits in their packed weight: (rows, columns) of its block, in order."""
    blocks, row, col = [], 0, 0
    for w in ws:
        n, k = w.shape
        blocks.append((slice(row, row + n), slice(col, col + k) if diagonal else slice(None)))
        row, col = row + n, col + (k if diagonal else 0)
    return blocks


def blocks_of(packed: torch.Tensor, ws: list[torch.Tensor], diagonal: bool = False) -> bool:
    """Whether `ws` are, in order, the row blocks (or diagonal blocks) of `packed` that tile it (none replaced)."""
    if any(w.dim() != 2 or w.device != packed.device or w.dtype != packed.dtype for w in ws):
        return False
    rows, cols = sum(w.shape[0] for w in ws), sum(w.shape[1] for w in ws) if diagonal else ws[0].shape[1]
    if (rows, cols) != tuple(packed.shape):
        return False
    views = [packed[block] for block in _blocks(ws, diagonal)]
    return all(
        w.shape == v.shape and w.stride() == v.stride() and w.data_ptr() == v.data_ptr() for w, v in zip(ws, views)
    )


def _key(linears: list[nn.Module]) -> list:
    """What identifies the linears' weights: (module id, data_ptr, dtype, shape) of each."""
    return [(id(lin), w.data_ptr(), w.dtype, w.shape) for lin in linears for w in [lin._parameters["weight"]]]


class WeightPack:
    """The packed weight of a fixed list of bias-free linears, built lazily by `weight`."""

    def __init__(self, diagonal: bool = False):
        self.diagonal = diagonal
        self.packed: torch.Tensor | None = None
        self.packings = 0
        self.key: list = []  # (module id, data_ptr, dtype, shape) of each weight when packed

    def weight(self, linears: list[nn.Module], x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight of `linears` for input `x`, packing it now if needed; None where the separate GEMMs
        run instead: off `PACK_DEVICES`, when autograd is on for the weights, where a projection is not a plain
        `nn.Linear` (`layers.plain_linear`: a hook or wrapper must run), for mixed dtypes, during a CUDA-graph
        capture that finds nothing packed (a replay would copy from freed weights: pack in the warm-up), or once
        the weights were replaced again after a repacking (a hook that swaps them on every call, as accelerate's
        offloading does, would otherwise keep a packed copy alive)."""
        ws = [lin._parameters["weight"] for lin in linears]
        if x.device.type not in PACK_DEVICES or (torch.is_grad_enabled() and any(w.requires_grad for w in ws)):
            return None
        if self.packed is not None and _key(linears) == self.key:
            return self.packed
        self.packed = None
        if self.packings == MAX_PACKINGS or not all(plain_linear(lin, x) for lin in linears):
            return None
        if any(w.dtype != ws[0].dtype for w in ws):
            return None
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        with torch.no_grad(), torch.inference_mode(False):
            blocks = _blocks(ws, self.diagonal)
            packed = self._pack([w.detach() for w in ws], blocks)
            for w, block in zip(ws, blocks):  # the same Parameter objects, now views
                w.data = packed[block]
        assert blocks_of(packed, ws, self.diagonal)
        self.packed, self.packings = packed, self.packings + 1
        self.key = _key(linears)
        return packed

    def forget_replaced(self, linears: list[nn.Module]) -> None:
        """Drop the packed weight if `linears`' weights were replaced since (so it does not stay alive unused)."""
        if self.packed is not None and _key(linears) != self.key:
            self.packed = None

    def _pack(self, ws: list[torch.Tensor], blocks: list[tuple[slice, slice]]) -> torch.Tensor:
        if not self.diagonal:
            return torch.cat(ws)
        packed = ws[0].new_zeros(blocks[-1][0].stop, blocks[-1][1].stop)
        for w, block in zip(ws, blocks):
            packed[block] = w
        return packed
