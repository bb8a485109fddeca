"""NORM: the kernels at real shapes and dtypes on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.norm import add_rms_norm_ref, add_rms_norm_triton, gated_rms_norm_ref, gated_rms_norm_triton

from ..conftest import TOL, assert_rel_close, rnd

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_empty")]


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_gpu_gated_bf16_real_shapes():
    """KDA's o_norm at the 48B shape: 32 heads of 128 per token."""
    x, gate = rnd(777, 32, 128, seed=8, dtype=torch.bfloat16), rnd(777, 32, 128, seed=9, dtype=torch.bfloat16)
    weight = rnd(128, seed=10)
    y = gated_rms_norm_triton(x, gate, weight, 1e-5)
    assert_rel_close("y", y, gated_rms_norm_ref(x, gate, weight, 1e-5), TOL[torch.bfloat16])


def test_gpu_add_bf16_model_width():
    x, res = rnd(257, 2304, seed=13, dtype=torch.bfloat16), rnd(257, 2304, seed=14, dtype=torch.bfloat16)
    w = rnd(2304, seed=15, dtype=torch.bfloat16)
    y, h = add_rms_norm_triton(x, res, w, 1e-5)
    ref_y, ref_h = add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(h, ref_h)
    assert_rel_close("y", y, ref_y, TOL[torch.bfloat16])
