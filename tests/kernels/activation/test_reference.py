"""ACTIVATION: the torch reference of SwiGLU's `silu(gate) * up`, and the module that uses it."""

from __future__ import annotations

import torch

from kimi_helix.kernels.activation import silu_mul_ref
from kimi_helix.kernels.backends import BackendChoice
from kimi_helix.modeling.layers import SwiGLU

from ..conftest import DEVICE, assert_rel_close, rnd


def test_reference_is_silu_times_up_in_the_inputs_dtype():
    gate, up = rnd(4, 24, seed=1, dtype=torch.float16) * 4.0, rnd(4, 24, seed=2, dtype=torch.float16)
    y = silu_mul_ref(gate, up)
    assert y.dtype == torch.float16
    # silu in fp32, rounded once to fp16, then the product rounded once: the two roundings `SwiGLU` always had
    g = gate.float()
    assert torch.equal(y, (g * torch.sigmoid(g)).half() * up)


def test_swiglu_is_down_of_the_activation():
    mlp = SwiGLU(16, 24).to(DEVICE)
    mlp.backends = BackendChoice(kernels="torch")
    x = rnd(4, 16, seed=3)
    with torch.no_grad():
        expect = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        # gate and up come from one launch as views of its output: torch's CPU silu on strided views may differ
        # from the contiguous one in the last bit
        assert_rel_close("swiglu", mlp(x), expect, 1e-6)
