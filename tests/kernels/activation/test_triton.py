"""ACTIVATION: the Triton kernel against the torch reference, on the CPU interpreter or a GPU."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.activation import silu_mul, silu_mul_ref
from kimi_helix.kernels.activation.triton import silu_mul_triton
from kimi_helix.modeling.layers import SwiGLU

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n", [48, 2100], ids=["I48", "I2100"])
def test_triton_matches_reference(dtype, n):
    gate, up = rnd(3, 2, n, seed=1, dtype=dtype) * 4.0, rnd(3, 2, n, seed=2, dtype=dtype)
    y = silu_mul_triton(gate, up)
    assert y.dtype == dtype and y.shape == gate.shape
    assert_rel_close("y", y, silu_mul_ref(gate, up), TOL[dtype])


def test_strided_halves_of_a_fused_projection():
    both = rnd(5, 64, seed=3)
    gate, up = both[:, :32], both[:, 32:]
    assert_rel_close("y", silu_mul_triton(gate, up), silu_mul_ref(gate, up), TOL[torch.float32])


def test_swiglu_dispatches_to_the_op():
    mlp = SwiGLU(16, 24).to(DEVICE)
    x = rnd(4, 16, seed=4)
    with torch.no_grad():
        expect = mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x), backend="triton"))
        assert_rel_close("swiglu", mlp(x), expect, TOL[torch.float32])


def test_bad_arguments_raise():
    x = rnd(2, 8, seed=5)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_triton(x, x[:, :4])
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_triton(x, x.half())
