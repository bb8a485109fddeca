"""ROTARY: the torch reference against rotate-half written out."""

from __future__ import annotations

import torch

from kimi_helix.kernels.rotary import inv_freq, rotary_ref

from ..conftest import DEVICE, assert_rel_close, rnd


def test_reference_rotates_pairs_i_and_i_plus_half():
    x = rnd(3, 2, 8, seed=1)
    pos = torch.tensor([0, 5, 1000], device=DEVICE)
    y = rotary_ref(x, pos, 10000.0)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, device=DEVICE).float() / 8)
    ang = pos.float()[:, None, None] * inv
    x1, x2 = x[..., :4], x[..., 4:]
    expect = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    assert_rel_close("y", y, expect, 1e-5)
    assert torch.equal(y[0], x[0])  # position 0 is the identity


def test_inverse_frequencies_are_one_cached_table():
    """One fp32 table per (D, theta, device): a CUDA graph captured after the first call replays that tensor."""
    table = inv_freq(8, 10000, DEVICE)
    assert table.dtype == torch.float32 and table.shape == (4,)
    assert inv_freq(8, 10000.0, DEVICE) is table
    assert torch.equal(table, 1.0 / 10000.0 ** (torch.arange(0, 8, 2, device=DEVICE).float() / 8))
