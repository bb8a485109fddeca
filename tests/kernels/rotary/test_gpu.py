"""ROTARY: the kernel at the model's shapes and dtype on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.rotary import rotary_ref
from kimi_helix.kernels.rotary.triton import rotary_triton

from ..conftest import TOL, assert_rel_close, rnd

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_empty")]


def test_gpu_bf16_rope_slice_of_the_query():
    """K3's MLA query: 96 heads of nope 128 + rope 64, the rope slice rotated at positions up to 1M."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q = rnd(333, 96, 192, seed=5, dtype=torch.bfloat16)
    pos = torch.randint(0, 1 << 20, (333,), generator=torch.Generator().manual_seed(6)).cuda()
    x = q[..., 128:]
    assert_rel_close("y", rotary_triton(x, pos, 50000.0), rotary_ref(x, pos, 50000.0), TOL[torch.bfloat16])
