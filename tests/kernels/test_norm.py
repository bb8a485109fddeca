"""Gated RMSNorm: the reference against the model's own formula, and the Triton kernel against the reference."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kimi_helix.kernels.norm import gated_rms_norm_ref, gated_rms_norm_triton  # noqa: E402
from kimi_helix.modeling.layers import GatedRMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled floats, so an output element the kernel never writes cannot pass."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def assert_rel_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Assert every element is finite and ||actual - expected|| / ||expected|| < tol (fp64)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, b = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol:.1e}"


def rnd(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


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


@pytest.mark.gpu
def test_gpu_bf16_real_shapes():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, gate = rnd(777, 32, 128, seed=8, dtype=torch.bfloat16), rnd(777, 32, 128, seed=9, dtype=torch.bfloat16)
    weight = rnd(128, seed=10)
    y = gated_rms_norm_triton(x, gate, weight, 1e-5)
    assert_rel_close("y", y, gated_rms_norm_ref(x, gate, weight, 1e-5), TOL[torch.bfloat16])
