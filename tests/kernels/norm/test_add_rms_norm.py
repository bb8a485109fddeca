"""Add + RMSNorm: the reference against the model's own layers, the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.norm.add_rms_norm import add_rms_norm, add_rms_norm_ref
from kimi_helix.kernels.norm.add_rms_norm_triton import add_rms_norm_triton
from kimi_helix.modeling.layers import RMSNorm

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


def test_reference_is_the_unfused_residual_block():
    """h = x + residual, then the pre-norm formula written out: fp32 norm, cast back, times the weight."""
    x, res, w = rnd(7, 48, seed=1, dtype=torch.bfloat16), rnd(7, 48, seed=2, dtype=torch.bfloat16), rnd(48, seed=3)
    w = w.bfloat16()
    y, h = add_rms_norm_ref(x, res, w, 1e-5)
    expect_h = res + x
    hf = expect_h.float()
    expect_y = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(h, expect_h) and torch.equal(y, expect_y)
    y_only, same = add_rms_norm_ref(x, None, w, 1e-5)
    assert same is x and torch.equal(y_only, add_rms_norm_ref(x, torch.zeros_like(x), w, 1e-5)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("D", [64, 40], ids=["D64", "D40"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "norm_only"])
def test_triton_matches_reference(dtype, D, with_residual):
    x = rnd(5, 3, D, seed=4, dtype=dtype) * 3.0
    res = rnd(5, 3, D, seed=5, dtype=dtype) if with_residual else None
    w = rnd(D, seed=6, dtype=dtype)
    y, h = add_rms_norm_triton(x, res, w, 1e-6)
    ref_y, ref_h = add_rms_norm_ref(x, res, w, 1e-6)
    assert y.dtype == ref_y.dtype and h.dtype == dtype
    assert_rel_close("y", y, ref_y, TOL[dtype])
    if with_residual:
        assert_rel_close("h", h, ref_h, TOL[dtype])
    else:
        assert h is x


def test_strided_rows_and_mixed_weight_dtype():
    """x sliced from a wider projection (as MLA's kv_a_layernorm reads it), fp32 weight over fp16 rows: the output
    takes the promoted dtype, as the torch expression does."""
    wide = rnd(6, 80, seed=7).half()
    x, w = wide[:, :64], rnd(64, seed=8)
    y, _ = add_rms_norm_triton(x, None, w, 0.5)
    ref, _ = add_rms_norm_ref(x, None, w, 0.5)
    assert y.dtype == torch.float32
    assert_rel_close("y", y, ref, TOL[torch.float16])


def test_rms_norm_module_dispatches_to_the_op():
    norm = RMSNorm(32, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(rnd(32, seed=9))
    x, res = rnd(4, 32, seed=10), rnd(4, 32, seed=11)
    y, h = norm.forward_add(x, res)
    ref_y, ref_h = add_rms_norm(x, res, norm.weight, 1e-6, backend="torch")
    assert_rel_close("forward_add", y, ref_y, TOL[torch.float32])
    assert_rel_close("forward", norm(h), ref_y, TOL[torch.float32])
    assert torch.equal(h, ref_h)


def test_bad_arguments_raise():
    x = rnd(2, 8, seed=12)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_triton(x, x[:, :4], torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_triton(x, None, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="x must"):
        add_rms_norm_triton(x.long(), None, torch.ones(8, device=DEVICE), 1e-6)


@pytest.mark.gpu
def test_gpu_bf16_model_width():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, res = rnd(257, 2304, seed=13, dtype=torch.bfloat16), rnd(257, 2304, seed=14, dtype=torch.bfloat16)
    w = rnd(2304, seed=15, dtype=torch.bfloat16)
    y, h = add_rms_norm_triton(x, res, w, 1e-5)
    ref_y, ref_h = add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(h, ref_h)
    assert_rel_close("y", y, ref_y, TOL[torch.bfloat16])
