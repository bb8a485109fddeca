"""Helpers shared by the kernel tests: the device, the relative-error check, NaN-poisoned torch.empty, random inputs.

Test modules import them with `from .conftest import ...`. tests/conftest.py has already set TRITON_INTERPRET=1 when
there is no GPU (and leaves it alone on one), so modules import the Triton kernels directly.
"""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def assert_rel_close(
    name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float, *, neg_inf_where_expected: bool = False
) -> float:
    """Assert every element of actual is finite and ||actual - expected|| / ||expected|| < tol (fp64, on the CPU);
    the error is reported on failure and returned.

    With neg_inf_where_expected, actual must be -inf exactly where expected is (an lse over no visible key), and only
    the other elements are compared.
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, b = actual.double().cpu(), expected.double().cpu()
    if neg_inf_where_expected:
        no_keys = b == float("-inf")
        assert (a[no_keys] == float("-inf")).all(), f"{name}: -inf expected where no key is visible"
        a, b = a[~no_keys], b[~no_keys]
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol:.1e}"
    return err


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty and torch.empty_like return NaN-filled floats, so an output or intermediate a kernel never writes
    cannot pass. Opt in per test (an argument) or per module (`pytestmark = pytest.mark.usefixtures("nan_empty")`)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))


def rnd(*shape, seed, dtype=torch.float32):
    """Standard normal values of a fixed seed, drawn on the CPU and moved to DEVICE as dtype."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def cu_seqlens(lens, dtype=torch.int32):
    """Sequence boundaries [0, l0, l0 + l1, ...] on DEVICE for packed sequences of the given lengths."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype, device=DEVICE)
