"""ROTARY: the kernel at the model's shapes and dtype on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.rotary import rotary_ref
from kimi_helix.kernels.rotary.triton import rotary_triton

from ..conftest import TOL, assert_rel_close, rnd

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_empty")]


@pytest.mark.parametrize("max_position", [4096, 1 << 20], ids=["4k", "1M"])
def test_gpu_bf16_rope_slice_of_the_query(max_position):
    """K3's MLA query: 96 heads of nope 128 + rope 64, the rope slice rotated at positions up to 4k and up to the
    1M context (angles up to 1e6 rad: the kernel's cos/sin must reduce them as precisely as torch's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q = rnd(333, 96, 192, seed=5, dtype=torch.bfloat16)
    pos = torch.randint(0, max_position, (333,), generator=torch.Generator().manual_seed(6)).cuda()
    x = q[..., 128:]
    assert_rel_close("y", rotary_triton(x, pos, 50000.0), rotary_ref(x, pos, 50000.0), TOL[torch.bfloat16])
