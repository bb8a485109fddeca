"""ROTARY: the Triton kernel against the torch reference, on the CPU interpreter or a GPU."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.rotary import rotary, rotary_ref
from kimi_helix.kernels.rotary.triton import rotary_triton
from kimi_helix.modeling.layers import apply_rotary

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


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
