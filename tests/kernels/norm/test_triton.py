"""NORM: the Triton kernels against the torch references, on the CPU interpreter or a GPU."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.backends import BackendChoice
from kimi_helix.kernels.norm import add_rms_norm_ref, add_rms_norm_triton, gated_rms_norm_ref, gated_rms_norm_triton
from kimi_helix.modeling.layers import GatedRMSNorm

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("D", [32, 48], ids=["D32", "D48"])
def test_gated_matches_reference(dtype, D):
    x, gate = rnd(5, 3, D, seed=1, dtype=dtype) * 3.0, rnd(5, 3, D, seed=2, dtype=dtype)
    weight = rnd(D, seed=3)
    y = gated_rms_norm_triton(x, gate, weight, 1e-6)
    ref = gated_rms_norm_ref(x, gate, weight, 1e-6)
    module = GatedRMSNorm(weight.shape[0], 1e-6).to(weight.device)
    module.backends = BackendChoice(kernels="torch")  # the module's torch path (on a GPU it would pick Triton)
    with torch.no_grad():
        module.weight.copy_(weight)
    assert y.dtype == dtype and torch.equal(ref, module(x, gate))
    assert_rel_close("y", y, ref, TOL[dtype])


def test_gated_strided_rows_and_large_eps():
    """Rows read with a stride (x and gate sliced from wider tensors); eps large enough to matter."""
    wide_x, wide_g = rnd(6, 64, seed=4), rnd(6, 80, seed=5).half()
    x, gate, weight = wide_x[:, :32], wide_g[:, 16:48], rnd(32, seed=6)
    y = gated_rms_norm_triton(x, gate, weight, 0.5)
    assert_rel_close("y", y, gated_rms_norm_ref(x, gate, weight, 0.5), 1e-5)


def test_gated_per_head_gate_of_a_wider_projection():
    """KDA's verify layout: x [T, H, K] contiguous, the gate a [T, H, K] slice of a wider projection (its tokens do
    not merge with its heads), read in place as per-head rows."""
    t, h, k = 6, 4, 32
    x, wide = rnd(t, h, k, seed=9) * 2.0, rnd(t, 5 * h * k, seed=10)
    gate, weight = wide[:, 3 * h * k : 4 * h * k].view(t, h, k), rnd(k, seed=11)
    y = gated_rms_norm_triton(x, gate, weight, 1e-6)
    assert_rel_close("y", y, gated_rms_norm_ref(x, gate, weight, 1e-6), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("D", [64, 40], ids=["D64", "D40"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "norm_only"])
def test_add_matches_reference(dtype, D, with_residual):
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


def test_add_strided_rows_and_mixed_weight_dtype():
    """x sliced from a wider projection (as MLA's kv_a_layernorm reads it), fp32 weight over fp16 rows: the output
    takes the promoted dtype, as the torch expression does."""
    wide = rnd(6, 80, seed=7).half()
    x, w = wide[:, :64], rnd(64, seed=8)
    y, _ = add_rms_norm_triton(x, None, w, 0.5)
    ref, _ = add_rms_norm_ref(x, None, w, 0.5)
    assert y.dtype == torch.float32
    assert_rel_close("y", y, ref, TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_per_head_rows_of_a_packed_projection_are_read_in_place(dtype):
    """q's heads sliced from a packed [q | k | v] projection, [N, G, H, hd] (the DSpark drafter's q/k norms): no
    single row stride covers them, so the kernels index (token, head) rows in place instead of copying them; a
    contiguous residual or gate is indexed the same way."""
    from kimi_helix.kernels.norm.triton import _rows

    n, g, h, d = 2, 3, 4, 32
    packed = rnd(n, g, 3 * h * d, seed=9, dtype=dtype) * 2.0
    q = packed[..., : h * d].view(n, g, h, d)
    rows, stride_outer, stride_inner, inner = _rows(q, d)
    assert rows is q and (stride_outer, stride_inner, inner) == (3 * h * d, d, h)
    w, res, gate = rnd(d, seed=10, dtype=dtype), rnd(n, g, h, d, seed=11, dtype=dtype), rnd(n, g, h, d, seed=12)
    for residual in (None, res):
        y, s = add_rms_norm_triton(q, residual, w, 1e-6)
        ref_y, ref_s = add_rms_norm_ref(q, residual, w, 1e-6)
        assert_rel_close("y", y, ref_y, TOL[dtype])
        assert_rel_close("h", s, ref_s, TOL[dtype])
    y = gated_rms_norm_triton(q, gate.to(dtype), w, 1e-6)
    assert_rel_close("gated", y, gated_rms_norm_ref(q, gate.to(dtype), w, 1e-6), TOL[dtype])


def test_empty_input_launches_nothing():
    x = torch.empty(0, 3, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    assert gated_rms_norm_triton(x, x, w, 1e-6).shape == x.shape
    y, h = add_rms_norm_triton(x, x, w, 1e-6)
    assert y.shape == h.shape == x.shape


# Each case calls a kernel with x [2, 8] and one bad argument; the error must name it.
BAD_ARGUMENTS = {
    "gated_gate_shape": (lambda x, w: gated_rms_norm_triton(x, x[:, :4], w, 1e-6), "gate"),
    "gated_weight_shape": (lambda x, w: gated_rms_norm_triton(x, x, w[:4], 1e-6), "weight"),
    "gated_x_dtype": (lambda x, w: gated_rms_norm_triton(x.long(), x, w, 1e-6), "x must"),
    "add_residual_shape": (lambda x, w: add_rms_norm_triton(x, x[:, :4], w, 1e-6), "residual"),
    "add_weight_shape": (lambda x, w: add_rms_norm_triton(x, None, w[:4], 1e-6), "weight"),
    "add_x_dtype": (lambda x, w: add_rms_norm_triton(x.long(), None, w, 1e-6), "x must"),
    "add_weight_device": (lambda x, w: add_rms_norm_triton(x, None, w.to("meta"), 1e-6), "weight is on meta"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_arguments_raise(case):
    call, match = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=match):
        call(rnd(2, 8, seed=7), torch.ones(8, device=DEVICE))
