"""Draft attention: the torch reference against a dense fp64 masked softmax written out here."""

from __future__ import annotations

import torch

from kimi_helix.kernels.draft_attention import draft_attention_ref

from ..conftest import DEVICE, TOL, assert_rel_close
from .conftest import N, make_inputs


def test_reference_is_a_dense_masked_softmax():
    """One softmax over the visible context rows and the whole block, at 1 / sqrt(D), written out in fp64."""
    g, h, d = 4, 2, 32
    q, k_blk, v_blk, kv, slots, lengths = make_inputs(g, h, d, torch.float32, seed=5)
    out = draft_attention_ref(q, k_blk, v_blk, *kv.unbind(2), slots, lengths)
    k = torch.cat([kv[slots, :, 0], k_blk], dim=1).double()
    v = torch.cat([kv[slots, :, 1], v_blk], dim=1).double()
    scores = torch.einsum("nghd,nkhd->nhgk", q.double(), k) / d**0.5
    c = kv.shape[1]
    visible = torch.cat(
        [torch.arange(c, device=DEVICE)[None] < lengths[:, None], torch.ones(N, g, dtype=torch.bool, device=DEVICE)],
        dim=1,
    )
    weights = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(dim=-1)
    assert_rel_close("out", out, torch.einsum("nhgk,nkhd->nghd", weights, v), TOL[torch.float32])
