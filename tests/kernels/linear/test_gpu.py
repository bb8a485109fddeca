"""Skinny `linear` on the GPU: bf16 at the kimi-linear-48b-a3b projection shapes against an fp32 reference."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.linear import linear_ref
from kimi_helix.kernels.linear.triton import linear_triton

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("n,k", [(4096, 2304), (2304, 4096), (576, 2304), (128, 2304), (4096, 128)])
def test_gpu_bf16_real_shapes(n, k):
    x, w = rnd(1, k, seed=13, dtype=torch.bfloat16), rnd(n, k, seed=14, dtype=torch.bfloat16) / k**0.5
    assert_rel_close("y", linear_triton(x, w), linear_ref(x.float(), w.float()), TOL[torch.bfloat16])
