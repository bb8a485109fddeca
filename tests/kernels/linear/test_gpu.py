"""Skinny `linear` on the GPU: bf16 at the kimi-linear-48b-a3b projection shapes against an fp32 reference, split
and unsplit; split-K replayed from a CUDA graph gives the eager call's bits."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.launch import cdiv
from kimi_helix.kernels.linear import linear_ref
from kimi_helix.kernels.linear.triton import default_tile, linear_triton, split_count, workspace

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = [
    pytest.mark.usefixtures("nan_empty"),
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU"),
]
# [N, K] of one launch: KDA q/k/v, o, f_b/g_b, f_a + g_a; MLA kv_a, q, o
SHAPES = {
    "kda.qkv": [(4096, 2304)] * 3,
    "kda.o": [(2304, 4096)],
    "kda.f_b": [(4096, 128)],
    "kda.f_a+g_a": [(128, 2304)] * 2,
    "mla.kv_a": [(576, 2304)],
    "mla.q": [(32 * 192, 2304)],
    "mla.o": [(2304, 4096)],
}


def weights(shapes, seed):
    return [rnd(n, k, seed=seed + i, dtype=torch.bfloat16) / k**0.5 for i, (n, k) in enumerate(shapes)]


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("splits", [None, 1, 4], ids=["auto", "unsplit", "s4"])
def test_gpu_bf16_real_shapes(name, splits):
    ws = weights(SHAPES[name], seed=14)
    x = rnd(1, ws[0].shape[1], seed=13, dtype=torch.bfloat16)
    ref = linear_ref(x.float(), [w.float() for w in ws])
    assert_rel_close("y", linear_triton(x, ws, splits=splits), ref, TOL[torch.bfloat16])


@pytest.mark.parametrize("name", ["kda.o", "kda.f_a+g_a", "mla.kv_a"])
def test_gpu_split_k_graph_replay_equals_eager(name):
    """Eager twice (bitwise equal: deterministic), then a captured graph replayed three times on new inputs copied
    into its input buffer: each replay bitwise equal to the eager call on that input, counters zero after."""
    ws = weights(SHAPES[name], seed=21)
    x = rnd(4, ws[0].shape[1], seed=22, dtype=torch.bfloat16)
    tile = default_tile(sum(w.shape[0] for w in ws), x.device.index)
    tiles = sum(cdiv(w.shape[0], tile.block_n) for w in ws)
    assert split_count(tiles, x.shape[-1], tile, 2, x.device.index) > 1, "the automatic choice does not split here"
    eager = linear_triton(x, ws)
    assert torch.equal(eager, linear_triton(x, ws)), "split-K is not deterministic"
    assert_rel_close("eager", eager, linear_ref(x.float(), [w.float() for w in ws]), TOL[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear_triton(x, ws)
    for seed in (23, 24, 25):
        x.copy_(rnd(*x.shape, seed=seed, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, linear_triton(x, ws)), f"replay on seed {seed} differs from eager"
    assert not workspace(x.device)[1].any(), "a counter was left non-zero"
