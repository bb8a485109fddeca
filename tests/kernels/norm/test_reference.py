"""NORM: the torch references against the formulas written out and the model's own modules."""

from __future__ import annotations

import torch

from kimi_helix.kernels.backends import BackendChoice
from kimi_helix.kernels.norm import add_rms_norm, add_rms_norm_ref, gated_rms_norm_ref
from kimi_helix.modeling.layers import GatedRMSNorm, RMSNorm

from ..conftest import DEVICE, TOL, assert_rel_close, rnd


def test_add_rms_norm_reference_is_the_unfused_residual_block():
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


def test_gated_rms_norm_reference_is_the_formula_and_the_module():
    """rmsnorm(x) * weight * sigmoid(gate) in fp32, cast to x's dtype; `GatedRMSNorm` (KDA's o_norm) computes it."""
    x, gate, weight = rnd(4, 3, 32, seed=4, dtype=torch.float16), rnd(4, 3, 32, seed=5), rnd(32, seed=6)
    xf = x.float()
    expect = (weight * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 0.1) * torch.sigmoid(gate)).half()
    ref = gated_rms_norm_ref(x, gate, weight, 0.1)
    assert ref.dtype == torch.float16 and torch.equal(ref, expect)
    module = GatedRMSNorm(32, 0.1).to(DEVICE)
    with torch.no_grad():
        module.weight.copy_(weight)
    module.backends = BackendChoice(kernels="torch")
    assert torch.equal(module(x, gate), ref)


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
