"""ACTIVATION: the kernel at the model's MLP width and dtype on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.activation import silu_mul_ref
from kimi_helix.kernels.activation.triton import silu_mul_triton

from ..conftest import TOL, assert_rel_close, rnd

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_empty")]


def test_gpu_bf16_gate_up_halves_of_the_dense_mlp():
    """The halves of a fused [T, 2 * 9216] gate/up projection (the 48B's dense MLP), strided rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    both = rnd(257, 2 * 9216, seed=4, dtype=torch.bfloat16) * 3.0
    gate, up = both[:, :9216], both[:, 9216:]
    assert_rel_close("y", silu_mul_triton(gate, up), silu_mul_ref(gate, up), TOL[torch.bfloat16])
