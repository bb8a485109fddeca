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


def make_kda_inputs(B, T, seed, dtype=torch.float32, *, h, k, v, n_states=None, raw_gate=False, lower_bound=None):
    """Random KDA inputs on DEVICE: q, k, v, g (log-decay, or the raw pre-activation when raw_gate), beta, s0, and the
    gate parameters (A_log, dt_bias)."""
    from kimi_helix.kernels.kda import kda_gate

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, kk, vv = randn(B, T, h, k), randn(B, T, h, k), randn(B, T, h, v)
    A_log = randn(h) * 0.5
    dt_bias = randn(h * k) * 0.5 - 1.0
    f = randn(B, T, h, k) * 3.0
    g = f if raw_gate else kda_gate(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(randn(B, T, h))
    s0 = randn(n_states or B, h, k, v) * 0.3
    out = [x.to(dtype) for x in (q, kk, vv)] + [g.to(dtype) if raw_gate else g, beta.to(dtype), s0, A_log, dt_bias]
    return [x.to(DEVICE) for x in out]


def kda_prefill_then_decode(decode, q, k, v, g, beta, s0, prefill_len):
    """naive_chunk_kda over every token, and over the first prefill_len tokens followed by `decode` one token at a time
    from the state the previous step left. Returns (stepped o, stepped final state, full o, full final state)."""
    from kimi_helix.kernels.kda import naive_chunk_kda

    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_full, s_full = naive_chunk_kda(q, k, v, g, beta, initial_state=s0, **kw)
    P = prefill_len
    o_pre, s = naive_chunk_kda(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], initial_state=s0, **kw)
    outs = [o_pre]
    for t in range(P, q.shape[1]):
        step = [x[:, t : t + 1] for x in (q, k, v, g, beta)]
        o_t, s = decode(*step, initial_state=s, **kw)
        outs.append(o_t)
    return torch.cat(outs, dim=1), s, o_full, s_full
