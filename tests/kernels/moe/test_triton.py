"""MOE: the Triton kernels against the torch references, on the CPU interpreter or a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kimi_helix.kernels.moe.triton as moe_triton
from kimi_helix.kernels.moe import SharedExperts, fused_experts_ref
from kimi_helix.kernels.moe.triton import MoeConfig, default_config, fused_experts_triton

from ..conftest import DEVICE, TOL, assert_rel_close
from .conftest import D, E, I, K, make_experts, make_shared, make_tokens, run_triton


def truth(x, gate_up, down, weights, ids, shared=None):
    """The reference in fp64 on the same (rounded) inputs."""
    shared64 = SharedExperts(*(w.double() for w in shared)) if shared is not None else None
    return fused_experts_ref(x.double(), gate_up.double(), down.double(), weights.double(), ids, shared64)


def decode_config(sort_pairs: bool, combine: bool = True) -> MoeConfig:
    return dataclasses.replace(default_config(1, E), sort_pairs=sort_pairs, combine_in_down=combine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_triton_matches_reference(T, dtype):
    gate_up, down = make_experts(E, D, I, dtype, seed=T)
    x, weights, ids = make_tokens(T, D, E, K, dtype, seed=100 + T)
    exact = truth(x, gate_up, down, weights, ids)
    assert_rel_close("triton", run_triton(x, gate_up, down, weights, ids), exact, TOL[dtype])
    assert_rel_close("reference", fused_experts_ref(x, gate_up, down, weights, ids), exact, TOL[dtype])


# shared intermediate: one slice of I, two, and a ragged 1.5 slices (a tensor-parallel shard need not fill one)
@pytest.mark.parametrize("shared_inter", [I, 2 * I, 3 * I // 2], ids=["one_slice", "two_slices", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_shared_experts_join_the_routed_sum(T, dtype, shared_inter):
    # T=1, 2: unsorted (the combine in the down kernel); T=9: sorted, the slices sorted as experts E, E+1
    gate_up, down = make_experts(E, D, I, dtype, seed=T)
    shared = make_shared(D, shared_inter, dtype, seed=50 + T)
    x, weights, ids = make_tokens(T, D, E, K, dtype, seed=60 + T)
    exact = truth(x, gate_up, down, weights, ids, shared)
    assert_rel_close("triton", run_triton(x, gate_up, down, weights, ids, shared=shared), exact, TOL[dtype])
    ref = fused_experts_ref(x, gate_up, down, weights, ids, shared)
    assert_rel_close("reference", ref, exact, TOL[dtype])


@pytest.mark.parametrize("sort_pairs, combine", [(True, True), (False, True), (False, False)])
def test_shared_experts_ragged_tiles(sort_pairs, combine):
    # I = 40 against 16/32-wide tiles: ragged k tails in both GEMMs, over routed and shared slices alike
    d, inter = 48, 40
    gate_up, down = make_experts(6, d, inter, torch.float32, seed=70)
    shared = make_shared(d, 100, torch.float32, seed=71)  # 2.5 slices
    x, weights, ids = make_tokens(3, d, 6, 3, torch.float32, seed=72)
    config = MoeConfig(16, 16, 32, 16, 32, num_warps=2, num_stages=2, sort_pairs=sort_pairs, combine_in_down=combine)
    y = run_triton(x, gate_up, down, weights, ids, config=config, shared=shared)
    assert_rel_close("triton", y, truth(x, gate_up, down, weights, ids, shared), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_residual_joins_the_sum(T, dtype):
    # T=1, 2: added inside the combine kernel; T=9: after the sorted path's sum. The residual is a strided view
    # (every other row of a wider tensor's columns), as a layer's packed hidden states may be.
    gate_up, down = make_experts(E, D, I, dtype, seed=90 + T)
    shared = make_shared(D, I, dtype, seed=91 + T)
    x, weights, ids = make_tokens(T, D, E, K, dtype, seed=92 + T)
    residual = torch.randn(T, 2 * D, dtype=dtype, generator=torch.Generator().manual_seed(93)).to(x.device)[:, :D]
    exact = truth(x, gate_up, down, weights, ids, shared).double() + residual.double()
    y = run_triton(x, gate_up, down, weights, ids, shared=shared, residual=residual)
    assert_rel_close("triton", y, exact, TOL[dtype])
    ref = fused_experts_ref(x, gate_up, down, weights, ids, shared, residual)
    assert_rel_close("reference", ref, exact, TOL[dtype])


@pytest.mark.parametrize("residual", [False, True])
def test_slot_sum_tiles(monkeypatch, residual):
    # the sorted path's slot sum over several ragged column tiles (d = 44 in tiles of 16), with the shared slices
    # as extra slots and a strided residual: every column of every token summed once, in fp32 with one rounding
    monkeypatch.setattr(moe_triton, "SUM_TILE_ELEMENTS", 64)
    d = 44
    gate_up, down = make_experts(6, d, 40, torch.float16, seed=84)
    shared = make_shared(d, 60, torch.float16, seed=85)
    x, weights, ids = make_tokens(9, d, 6, 3, torch.float16, seed=86)
    res = torch.randn(9, 2 * d, dtype=torch.float16, generator=torch.Generator().manual_seed(87)).to(x.device)[:, :d]
    config = dataclasses.replace(default_config(64, 6), sort_pairs=True)
    y = run_triton(x, gate_up, down, weights, ids, config=config, shared=shared, residual=res if residual else None)
    exact = truth(x, gate_up, down, weights, ids, shared) + (res.double() if residual else 0)
    assert_rel_close("triton", y, exact, TOL[torch.float16])


@pytest.mark.parametrize(
    "d, block_k_gate_up, block_n, block_k",
    [(20, 16, 1, 16), (44, 32, 4, 64), (44, 32, 8, 32)],
    ids=["one_col", "k_past_I", "ragged"],
)
def test_combine_down_gemv_tiles(d, block_k_gate_up, block_n, block_k):
    # the decode combine is a GEMV: any column tile, K steps wider than I or ragged against it, d not a multiple
    # of the tile, and a ragged shared slice. One column a program runs d programs a row (slow in the interpreter),
    # so that case takes a narrower d, still ragged against its gate/up K tile.
    inter = 40
    gate_up, down = make_experts(6, d, inter, torch.float32, seed=80)
    shared = make_shared(d, 60, torch.float32, seed=81)
    x, weights, ids = make_tokens(2, d, 6, 3, torch.float32, seed=82)
    config = MoeConfig(16, 16, block_k_gate_up, block_n, block_k, num_warps=2, num_stages=2, sort_pairs=False)
    y = run_triton(x, gate_up, down, weights, ids, config=config, shared=shared)
    assert_rel_close("triton", y, truth(x, gate_up, down, weights, ids, shared), TOL[torch.float32])


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


@pytest.mark.parametrize("sort_pairs, combine", [(True, True), (False, True), (False, False)])
def test_experts_without_tokens(sort_pairs, combine):
    # the first and last experts, and four between, receive nothing
    gate_up, down = make_experts(E, D, I, torch.float32, seed=5)
    x, weights, _ = make_tokens(5, D, E, K, torch.float32, seed=6)
    ids = torch.tensor([[2, 5], [5, 2], [2, 5], [5, 2], [2, 5]], device=DEVICE)
    y = run_triton(x, gate_up, down, weights, ids, config=decode_config(sort_pairs, combine))
    assert_rel_close("triton", y, truth(x, gate_up, down, weights, ids), TOL[torch.float32])


@pytest.mark.parametrize("sort_pairs", [True, False])
@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_to_one_expert(top_k, sort_pairs):
    # sorted: 33 pairs on one expert span three 16-row blocks; unsorted (a program per pair, for decode's few
    # tokens) 9 tokens. With k == 1 every other expert, the last included, is empty.
    gate_up, down = make_experts(E, D, I, torch.float16, seed=7)
    x, weights, ids = make_tokens(33 if sort_pairs else 9, D, E, top_k, torch.float16, seed=8)
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
    shared = make_shared(D, I, torch.float32)
    with pytest.raises(ValueError, match="shared must"):
        fused_experts_triton(x, gate_up, down, weights, ids, SharedExperts(shared.gate, shared.up, shared.gate))
    with pytest.raises(ValueError, match="share"):
        fused_experts_triton(x, gate_up, down, weights, ids, SharedExperts(*(w.half() for w in shared)))
    with pytest.raises(ValueError, match="out must"):
        fused_experts_triton(x, gate_up, down, weights, ids, out=torch.empty_like(x).half())
