"""Rotary embedding: the reference against rotate-half written out, the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.rotary import rotary, rotary_ref
from kimi_helix.kernels.rotary.triton import rotary_triton
from kimi_helix.modeling.layers import apply_rotary

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference_on_a_head_slice(dtype):
    """The rope part q[..., nope:] of a [T, H, nope + rope] projection (strided rows and heads), long positions."""
    q = rnd(6, 3, 24, seed=2, dtype=dtype)
    x = q[..., 16:]
    pos = torch.tensor([0, 1, 7, 4095, 32767, 9], device=DEVICE)
    y = rotary_triton(x, pos, 10000.0)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert_rel_close("y", y, rotary_ref(x, pos, 10000.0), TOL[dtype])


def test_triton_two_dim_input_and_dispatch():
    """A shared rope key [T, D] sliced from a wider latent row, through `apply_rotary` on the op switch."""
    wide = rnd(5, 40, seed=3)
    k_pe, pos = wide[:, 32:], torch.arange(5, device=DEVICE) * 100
    ref = rotary(k_pe, pos, 50000.0, backend="torch")
    assert_rel_close("y", rotary(k_pe, pos, 50000.0, backend="triton"), ref, TOL[torch.float32])
    assert torch.equal(apply_rotary(k_pe, pos, 50000.0), rotary(k_pe, pos, 50000.0))


def test_bad_arguments_raise():
    x = rnd(2, 4, 6, seed=4)
    with pytest.raises(ValueError, match="D even"):
        rotary_triton(x[..., :5], torch.zeros(2, dtype=torch.long, device=DEVICE), 1e4)
    with pytest.raises(ValueError, match="positions"):
        rotary_triton(x, torch.zeros(3, dtype=torch.long, device=DEVICE), 1e4)
