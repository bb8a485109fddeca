"""Helpers shared by the moe kernel tests (imported with `from .conftest import ...`)."""

from __future__ import annotations

import contextlib
import math

import torch

from kimi_helix.kernels.moe import SharedExperts
from kimi_helix.kernels.moe.triton import fused_experts_triton

from ..conftest import DEVICE

E, K, D, I = 8, 2, 32, 16


@contextlib.contextmanager
def poisoned_empty():
    """Make torch.empty return NaN (floats) and the max value (ints): an element a kernel skips shows up."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling


def make_experts(n_experts, d, inter, dtype, seed=0, device=DEVICE):
    """Random stacked expert weights scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n_experts, 2 * inter, d, generator=g) / math.sqrt(d)
    down = torch.randn(n_experts, d, inter, generator=g) / math.sqrt(inter)
    return gate_up.to(device, dtype), down.to(device, dtype)


def make_shared(d, shared_inter, dtype, seed=2, device=DEVICE) -> SharedExperts:
    """Random shared-expert SwiGLU weights: gate, up [I_s, d], down [d, I_s]."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(2, shared_inter, d, generator=g) / math.sqrt(d)).to(device, dtype)
    down = (torch.randn(d, shared_inter, generator=g) / math.sqrt(shared_inter)).to(device, dtype)
    return SharedExperts(gate, up, down)


def make_tokens(T, d, n_experts, top_k, dtype, seed=1, device=DEVICE):
    """x [T, d], positive weights [T, k] fp32 and k distinct random experts per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    weights = torch.rand(T, top_k, generator=g) + 0.1
    ids = torch.rand(T, n_experts, generator=g).argsort(dim=1)[:, :top_k]
    return x.to(device, dtype), weights.to(device), ids.to(device)


def run_triton(x, gate_up, down, weights, ids, config=None, shared=None, residual=None):
    """The kernel on a NaN-filled output, with every internal buffer poisoned too."""
    out = torch.full_like(x, float("nan"))
    with poisoned_empty():
        y = fused_experts_triton(x, gate_up, down, weights, ids, shared, residual, out=out, config=config)
    assert y is out and y.dtype == x.dtype
    return y
