"""MoE router: the fused Triton top-k against `moe_router_ref` (ids exactly, weights to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.router import moe_router, moe_router_ref
from kimi_helix.kernels.router.triton import LOGITS_KERNEL_MAX_TOKENS, moe_router_triton, router_logits

from ..conftest import TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


def _inputs(T, d, E, seed, dtype=torch.float32):
    x = rnd(T, d, seed=seed, dtype=dtype)
    weight = rnd(E, d, seed=seed + 1) * 0.3
    bias = rnd(E, seed=seed + 2) * 0.1
    return x, weight, bias


@pytest.mark.parametrize(
    "E,top_k,groups,topk_group,activation",
    [(16, 4, 1, 1, "sigmoid"), (24, 3, 4, 2, "sigmoid"), (32, 8, 8, 3, "softmax"), (10, 2, 1, 1, "softmax")],
    ids=["sigmoid", "grouped", "grouped_softmax", "non_pow2_experts"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T", [1, 3, 9], ids=["T1", "T3", "T9"])  # the logits kernel up to 8 tokens, a GEMM past
def test_triton_matches_reference(E, top_k, groups, topk_group, activation, dtype, T):
    x, weight, bias = _inputs(T, 40, E, seed=T, dtype=dtype)
    args = (x, weight, bias, top_k, groups, topk_group, True, 2.446, activation)
    w, ids = moe_router_triton(*args)
    ref_w, ref_ids = moe_router_ref(*args)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    assert_rel_close("weights", w, ref_w, TOL[torch.float32])


def test_no_bias_no_renormalisation():
    x, weight, _ = _inputs(5, 16, 8, seed=4)
    w, ids = moe_router_triton(x, weight, None, 2, renormalize=False, scaling=1.0)
    ref_w, ref_ids = moe_router_ref(x, weight, None, 2, renormalize=False, scaling=1.0)
    assert torch.equal(ids, ref_ids)
    assert_rel_close("weights", w, ref_w, TOL[torch.float32])


def test_bias_selects_but_does_not_weigh():
    """A large bias on one expert makes it chosen by every token, yet its weight is its unbiased score."""
    x, weight, bias = _inputs(6, 16, 8, seed=5)
    bias = torch.zeros_like(bias)
    bias[3] = 100.0
    w, ids = moe_router(x, weight, bias, 2, renormalize=False, backend="triton")
    assert (ids[:, 0] == 3).all()
    assert_rel_close("weight of expert 3", w[:, 0], torch.sigmoid(x @ weight[3]), TOL[torch.float32])


def test_nan_rows_still_give_valid_expert_ids():
    """A CUDA graph's padded rows may carry garbage; their ids must still index real experts."""
    x, weight, bias = _inputs(3, 16, 8, seed=6)
    x[1] = float("nan")
    _, ids = moe_router_triton(x, weight, bias, 2)
    assert ((ids >= 0) & (ids < 8)).all()


def test_bad_arguments_raise():
    x, weight, bias = _inputs(2, 16, 8, seed=7)
    with pytest.raises(ValueError, match="num_groups"):
        moe_router_triton(x, weight, bias, 2, num_groups=3)
    with pytest.raises(ValueError, match="topk_group"):
        moe_router_triton(x, weight, bias, 2, num_groups=2, topk_group=3)
    with pytest.raises(ValueError, match="top_k"):
        moe_router_triton(x, weight, bias, 9)
    with pytest.raises(ValueError, match="activation"):
        moe_router_triton(x, weight, bias, 2, activation="relu")


@pytest.mark.parametrize("d", [40, 1000])  # all tokens reduced at once; two at a time (ROWS = TILE_ELEMENTS // 1024)
def test_logits_kernel_matches_the_gemm(d):
    # every token count the kernel serves, a hidden size not a power of two, strided x rows
    weight = rnd(12, d, seed=9)
    for T in range(1, LOGITS_KERNEL_MAX_TOKENS + 1):
        x = rnd(T, d + 16, seed=10 + T)[:, :d]
        assert_rel_close(f"logits T={T}", router_logits(x, weight), x @ weight.T, TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 5, 8, 300])
def test_gpu_kimi_linear_shapes(T):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, weight, bias = _inputs(T, 2304, 256, seed=8 + T, dtype=torch.bfloat16)
    args = (x, weight, bias, 8, 1, 1, True, 2.446, "sigmoid")
    w, ids = moe_router_triton(*args)
    ref_w, ref_ids = moe_router_ref(*args)
    # the same experts; their order may differ where two scores tie to fp32 rounding (the kernel sums in its order)
    ids, order = ids.sort(dim=1)
    ref_ids, ref_order = ref_ids.sort(dim=1)
    assert torch.equal(ids, ref_ids)
    assert_rel_close("weights", w.gather(1, order), ref_w.gather(1, ref_order), TOL[torch.float32])
