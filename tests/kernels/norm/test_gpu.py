"""NORM: the kernels at real shapes and dtypes on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.norm import gated_rms_norm_ref, gated_rms_norm_triton

from ..conftest import TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.gpu
def test_gpu_bf16_real_shapes():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, gate = rnd(777, 32, 128, seed=8, dtype=torch.bfloat16), rnd(777, 32, 128, seed=9, dtype=torch.bfloat16)
    weight = rnd(128, seed=10)
    y = gated_rms_norm_triton(x, gate, weight, 1e-5)
    assert_rel_close("y", y, gated_rms_norm_ref(x, gate, weight, 1e-5), TOL[torch.bfloat16])
