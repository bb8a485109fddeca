"""Routed MoE: the router and expert references against the modelling modules, and the fused Triton experts against
the reference (fp32, fp16; bf16 at Kimi-Linear shapes on the GPU), with NaN-poisoned buffers, experts that get no
token, one expert that gets every token, CUDA-graph capture, and the benchmark's smoke mode."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import kimi_helix.kernels.moe.triton as moe_triton
from kimi_helix import KimiK3Config
from kimi_helix.kernels.moe import fused_experts_ref, moe_router_ref
from kimi_helix.kernels.moe.triton import MoeConfig, default_config, fused_experts_triton
from kimi_helix.modeling.moe import RoutedExperts, TopkRouter

from .conftest import DEVICE, TOL, assert_rel_close

E, K, D, I = 8, 2, 32, 16
BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_moe.py"


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


def make_tokens(T, d, n_experts, top_k, dtype, seed=1, device=DEVICE):
    """x [T, d], positive weights [T, k] fp32 and k distinct random experts per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    weights = torch.rand(T, top_k, generator=g) + 0.1
    ids = torch.rand(T, n_experts, generator=g).argsort(dim=1)[:, :top_k]
    return x.to(device, dtype), weights.to(device), ids.to(device)


def run_triton(x, gate_up, down, weights, ids, config=None):
    """The kernel on a NaN-filled output, with every internal buffer poisoned too."""
    out = torch.full_like(x, float("nan"))
    with poisoned_empty():
        y = fused_experts_triton(x, gate_up, down, weights, ids, out=out, config=config)
    assert y is out and y.dtype == x.dtype
    return y


def truth(x, gate_up, down, weights, ids):
    """The reference in fp64 on the same (rounded) inputs."""
    return fused_experts_ref(x.double(), gate_up.double(), down.double(), weights.double(), ids)


def router_config(**overrides):
    kw = dict(hidden_size=D, num_experts=E, num_experts_per_token=K, moe_intermediate_size=I)
    kw.update(overrides)
    return KimiK3Config(**kw)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2, "num_experts_per_token": 3},
        {"moe_router_activation_func": "softmax", "routed_scaling_factor": 1.0},
        {"moe_renormalize": False},
    ],
)
def test_router_ref_matches_topk_router(overrides):
    cfg = router_config(**overrides)
    router = TopkRouter(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.rand(E, generator=g) * 0.5)
        x = torch.randn(9, D, generator=g).half()
        expected_w, expected_ids = router(x)
    weights, ids = moe_router_ref(
        x,
        router.weight,
        router.e_score_correction_bias,
        router.top_k,
        router.num_groups,
        router.topk_group,
        router.renormalize,
        router.scaling,
        router.activation,
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_w)


def test_router_ref_rejects_bad_arguments():
    x, w = torch.randn(2, D), torch.randn(E, D)
    with pytest.raises(ValueError, match="activation"):
        moe_router_ref(x, w, None, 2, activation="relu")
    with pytest.raises(ValueError, match="num_groups"):
        moe_router_ref(x, w, None, 2, num_groups=3, topk_group=1)


def test_ref_matches_routed_experts():
    experts = RoutedExperts(router_config())
    gate_up, down = make_experts(E, D, I, torch.float32, device="cpu")
    x, weights, ids = make_tokens(7, D, E, K, torch.float32, device="cpu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        expected = experts(x, weights, ids)
    assert torch.equal(fused_experts_ref(x, gate_up, down, weights, ids), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_triton_matches_reference(T, dtype):
    gate_up, down = make_experts(E, D, I, dtype, seed=T)
    x, weights, ids = make_tokens(T, D, E, K, dtype, seed=100 + T)
    exact = truth(x, gate_up, down, weights, ids)
    assert_rel_close("triton", run_triton(x, gate_up, down, weights, ids), exact, TOL[dtype])
    assert_rel_close("reference", fused_experts_ref(x, gate_up, down, weights, ids), exact, TOL[dtype])


@pytest.mark.parametrize(
    "config",
    [MoeConfig(16, 16, 16, 16, 16), MoeConfig(32, 32, 16, 16, 32, num_warps=2, num_stages=2)],
    ids=["even_k", "ragged_k"],
)
def test_tiles_smaller_than_the_problem(config):
    # d and I not multiples of every tile: several N tiles with a ragged last one, and K loops with a ragged tail;
    # and an expert count that is not a power of two
    d, inter, n_experts = 48, 40, 6
    gate_up, down = make_experts(n_experts, d, inter, torch.float32, seed=3)
    x, weights, ids = make_tokens(21, d, n_experts, K, torch.float32, seed=4)
    y = run_triton(x, gate_up, down, weights, ids, config=config)
    assert_rel_close("triton", y, truth(x, gate_up, down, weights, ids), TOL[torch.float32])


def decode_config(sort_pairs: bool) -> MoeConfig:
    return dataclasses.replace(default_config(1, E), sort_pairs=sort_pairs)


@pytest.mark.parametrize("sort_pairs", [True, False])
def test_experts_without_tokens(sort_pairs):
    # the first and last experts, and four between, receive nothing
    gate_up, down = make_experts(E, D, I, torch.float32, seed=5)
    x, weights, _ = make_tokens(5, D, E, K, torch.float32, seed=6)
    ids = torch.tensor([[2, 5], [5, 2], [2, 5], [5, 2], [2, 5]], device=DEVICE)
    y = run_triton(x, gate_up, down, weights, ids, config=decode_config(sort_pairs))
    assert_rel_close("triton", y, truth(x, gate_up, down, weights, ids), TOL[torch.float32])


@pytest.mark.parametrize("sort_pairs", [True, False])
@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_to_one_expert(top_k, sort_pairs):
    # 33 pairs on one expert span three 16-row blocks; with k == 1 every other expert, the last included, is empty
    gate_up, down = make_experts(E, D, I, torch.float16, seed=7)
    x, weights, ids = make_tokens(33, D, E, top_k, torch.float16, seed=8)
    ids[:, 0] = 0 if top_k == 1 else E - 1
    if top_k == 2:
        ids[:, 1] = ids[:, 1] % (E - 1)
    y = run_triton(x, gate_up, down, weights, ids, config=decode_config(sort_pairs))
    assert_rel_close("triton", y, truth(x, gate_up, down, weights, ids), TOL[torch.float16])


@pytest.mark.parametrize("align_block, hist_block", [(16, 16), (16, 64), (64, 16)])
def test_sort_across_programs_and_histogram_steps(monkeypatch, align_block, hist_block):
    # shrunk so 66 pairs take several align programs and several histogram steps, as thousands do on the GPU
    monkeypatch.setattr(moe_triton, "ALIGN_BLOCK", align_block)
    monkeypatch.setattr(moe_triton, "HIST_BLOCK", hist_block)
    gate_up, down = make_experts(E, D, I, torch.float32, seed=12)
    x, weights, ids = make_tokens(33, D, E, K, torch.float32, seed=13)
    ids[:20, 0] = 4  # one expert spans blocks, so ranks carry across programs
    ids[:20, 1] = ids[:20, 1] % 4
    y = run_triton(x, gate_up, down, weights, ids)
    assert_rel_close("triton", y, truth(x, gate_up, down, weights, ids), TOL[torch.float32])


def test_int32_ids_strided_x_and_no_tokens():
    gate_up, down = make_experts(E, D, I, torch.float32, seed=9)
    wide, weights, ids = make_tokens(6, 2 * D, E, K, torch.float32, seed=10)
    x = wide[:, :D]  # rows 2D apart
    y = run_triton(x, gate_up, down, weights, ids.int())
    assert_rel_close("triton", y, truth(x, gate_up, down, weights, ids), TOL[torch.float32])
    empty = fused_experts_triton(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, D)


def test_bad_inputs_raise():
    gate_up, down = make_experts(E, D, I, torch.float32)
    x, weights, ids = make_tokens(3, D, E, K, torch.float32)
    with pytest.raises(ValueError, match="x must"):
        fused_experts_triton(x[0], gate_up, down, weights, ids)
    with pytest.raises(ValueError, match="gate_up_proj"):
        fused_experts_triton(x, gate_up[:, :-1], down, weights, ids)
    with pytest.raises(ValueError, match="down_proj"):
        fused_experts_triton(x, gate_up, down.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="weights and ids"):
        fused_experts_triton(x, gate_up, down, weights[:, :1], ids)
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_experts_triton(x, gate_up, down, weights, ids.float())
    with pytest.raises(ValueError, match="share"):
        fused_experts_triton(x.half(), gate_up, down, weights, ids)
    with pytest.raises(ValueError, match="out must"):
        fused_experts_triton(x, gate_up, down, weights, ids, out=torch.empty_like(x).half())


def test_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_moe", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "moe.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in rows} >= {"triton", "torch_ref"}
    keys = {"gpu", "date", "commit", "tokens", "backend", "ms", "tbps_weights", "pct_of_bw_floor", "tflops"}
    for r in rows:
        assert keys <= r.keys() and r["ms"] > 0


# ---------------------------------------------------------------- GPU: bf16 at Kimi-Linear shapes
KIMI = dict(n_experts=256, top_k=8, d=2304, inter=1024)


@pytest.fixture(scope="module")
def kimi_experts():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gate_up, down = make_experts(KIMI["n_experts"], KIMI["d"], KIMI["inter"], torch.bfloat16, seed=11)
    return gate_up, down, gate_up.double(), down.double()


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
