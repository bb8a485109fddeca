"""MOE: the kernels at real shapes and dtypes on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import math

import pytest
import torch

from kimi_helix.kernels.moe import SharedExperts, fused_experts_ref, moe_router_ref
from kimi_helix.kernels.moe.triton import default_config, fused_experts_triton

from ..conftest import TOL, assert_rel_close
from .conftest import make_experts, make_shared, make_tokens, run_triton

# ---------------------------------------------------------------- GPU: bf16 at Kimi-Linear shapes
KIMI = dict(n_experts=256, top_k=8, d=2304, inter=1024)


@pytest.fixture(scope="module")
def kimi_experts():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gate_up, down = make_experts(KIMI["n_experts"], KIMI["d"], KIMI["inter"], torch.bfloat16, seed=11)
    return gate_up, down, gate_up.double(), down.double()


@pytest.fixture(scope="module")
def kimi_shared():
    """One shared expert of intermediate I (Kimi-Linear-48B), bf16, and its fp64 copy."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shared = make_shared(KIMI["d"], KIMI["inter"], torch.bfloat16, seed=12)
    return shared, SharedExperts(*(w.double() for w in shared))


def kimi_routing(T, seed):
    """Tokens routed by the reference router with a random router weight and correction bias."""
    x, _, _ = make_tokens(T, KIMI["d"], KIMI["n_experts"], KIMI["top_k"], torch.bfloat16, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    router_w = (torch.randn(KIMI["n_experts"], KIMI["d"], generator=g) / math.sqrt(KIMI["d"])).cuda()
    bias = (torch.rand(KIMI["n_experts"], generator=g) * 0.1).cuda()
    weights, ids = moe_router_ref(x, router_w, bias, KIMI["top_k"], scaling=2.446)
    return x, weights, ids


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 16, 512])
def test_gpu_bf16_kimi_shapes(kimi_experts, T):
    gate_up, down, gate_up64, down64 = kimi_experts
    x, weights, ids = kimi_routing(T, seed=T)
    exact = fused_experts_ref(x.double(), gate_up64, down64, weights.double(), ids)
    assert_rel_close("triton", run_triton(x, gate_up, down, weights, ids), exact, TOL[torch.bfloat16])
    assert_rel_close("reference", fused_experts_ref(x, gate_up, down, weights, ids), exact, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("pairs_per_expert", [1, 64, 1024])
def test_gpu_bf16_every_default_tier(kimi_experts, pairs_per_expert):
    # 512 tokens through the decode, mid and prefill tile choices
    gate_up, down, gate_up64, down64 = kimi_experts
    x, weights, ids = kimi_routing(512, seed=21)
    config = default_config(pairs_per_expert * KIMI["n_experts"], KIMI["n_experts"])
    exact = fused_experts_ref(x.double(), gate_up64, down64, weights.double(), ids)
    assert_rel_close("triton", run_triton(x, gate_up, down, weights, ids, config=config), exact, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_cuda_graph_replay(kimi_experts, T):
    # no host sync: the call captures (unsorted at T=1, sorted at 16); a replay on new routing matches eager
    gate_up, down, _, _ = kimi_experts
    x, weights, ids = kimi_routing(T, seed=31)
    fused_experts_triton(x, gate_up, down, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_experts_triton(x, gate_up, down, weights, ids)
    x2, weights2, ids2 = kimi_routing(T, seed=32)
    for static, new in ((x, x2), (weights, weights2), (ids, ids2)):
        static.copy_(new)
    graph.replay()
    torch.testing.assert_close(y, fused_experts_triton(x2, gate_up, down, weights2, ids2), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 5, 64, 512])
def test_gpu_bf16_shared_experts_in_the_kernels(kimi_experts, kimi_shared, T):
    # T <= 2: unsorted with the combine in the down kernel; 5 (a verify group), 64, 512: sorted
    gate_up, down, gate_up64, down64 = kimi_experts
    shared, shared64 = kimi_shared
    x, weights, ids = kimi_routing(T, seed=40 + T)
    exact = fused_experts_ref(x.double(), gate_up64, down64, weights.double(), ids, shared64)
    y = run_triton(x, gate_up, down, weights, ids, shared=shared)
    assert_rel_close("triton", y, exact, TOL[torch.bfloat16])
    # deterministic: no atomics, a second call is bitwise the same
    torch.testing.assert_close(run_triton(x, gate_up, down, weights, ids, shared=shared), y, rtol=0, atol=0)
    # the decoder layer's residual, added inside (unsorted) or after the sum (sorted)
    residual = torch.randn_like(x)
    y = run_triton(x, gate_up, down, weights, ids, shared=shared, residual=residual)
    assert_rel_close("triton + residual", y, exact + residual.double(), TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_cuda_graph_replay_with_shared_experts(kimi_experts, kimi_shared, T):
    gate_up, down, _, _ = kimi_experts
    shared, _ = kimi_shared
    x, weights, ids = kimi_routing(T, seed=51)
    fused_experts_triton(x, gate_up, down, weights, ids, shared)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_experts_triton(x, gate_up, down, weights, ids, shared)
    x2, weights2, ids2 = kimi_routing(T, seed=52)
    for static, new in ((x, x2), (weights, weights2), (ids, ids2)):
        static.copy_(new)
    graph.replay()
    expected = fused_experts_triton(x2, gate_up, down, weights2, ids2, shared)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
