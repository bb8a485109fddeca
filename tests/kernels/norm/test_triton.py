"""NORM: the Triton kernels against the torch references, on the CPU interpreter or a GPU."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.norm import gated_rms_norm_ref, gated_rms_norm_triton
from kimi_helix.modeling.layers import GatedRMSNorm

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("D", [32, 48], ids=["D32", "D48"])
def test_triton_matches_reference(dtype, D):
    x, gate = rnd(5, 3, D, seed=1, dtype=dtype) * 3.0, rnd(5, 3, D, seed=2, dtype=dtype)
    weight = rnd(D, seed=3)
    y = gated_rms_norm_triton(x, gate, weight, 1e-6)
    ref = gated_rms_norm_ref(x, gate, weight, 1e-6)
    module = GatedRMSNorm(weight.shape[0], 1e-6).to(weight.device)
    with torch.no_grad():
        module.weight.copy_(weight)
    assert y.dtype == dtype and torch.equal(ref, module(x, gate))
    assert_rel_close("y", y, ref, TOL[dtype])


def test_strided_rows_and_large_eps():
    """Rows read with a stride (x and gate sliced from wider tensors); eps large enough to matter."""
    wide_x, wide_g = rnd(6, 64, seed=4), rnd(6, 80, seed=5).half()
    x, gate, weight = wide_x[:, :32], wide_g[:, 16:48], rnd(32, seed=6)
    y = gated_rms_norm_triton(x, gate, weight, 0.5)
    assert_rel_close("y", y, gated_rms_norm_ref(x, gate, weight, 0.5), 1e-5)


def test_bad_arguments_raise():
    x = rnd(2, 8, seed=7)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm_triton(x, x[:, :4], torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm_triton(x, x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="x must"):
        gated_rms_norm_triton(x.long(), x, torch.ones(8, device=DEVICE), 1e-6)
