"""Inputs shared by the draft attention tests."""

from __future__ import annotations

import torch

from kimi_helix.kernels.draft_attention.triton import block_c

from ..conftest import DEVICE, rnd

S, N = 10, 7  # more slots than requests, so unused (poisoned) slots sit between the used ones


def make_inputs(g, h, d, dtype, seed):
    """N requests in shuffled slots of S, lengths at 0, 1, a tile edge and either side, two tiles and C (two tiles
    and a ragged third); q, k_blk, v_blk are views of one packed qkv. Returns (q, k_blk, v_blk, kv [S, C, 2, H, D],
    slots, lengths): k_ctx, v_ctx = kv.unbind(2) are strided halves of one interleaved cache."""
    t = block_c(d)
    c = 2 * t + 5
    lengths = torch.tensor([0, 1, t - 1, t, t + 1, 2 * t, c], device=DEVICE)
    slots = torch.randperm(S, generator=torch.Generator().manual_seed(seed))[:N].to(DEVICE)
    q, k_blk, v_blk = rnd(N, g, 3, h, d, seed=seed, dtype=dtype).unbind(2)
    return q, k_blk, v_blk, rnd(S, c, 2, h, d, seed=seed + 1, dtype=dtype), slots, lengths


def poison_unseen(kv, slots, lengths):
    """A copy of the cache whose rows no request sees (unused slots, rows at or past a length) are NaN."""
    out = torch.full_like(kv, float("nan"))
    for s, n in zip(slots.tolist(), lengths.tolist(), strict=True):
        out[s, :n] = kv[s, :n]
    return out
