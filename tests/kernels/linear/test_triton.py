"""Skinny `linear`: the Triton kernel against the torch reference (`F.linear`, per weight), several weights in one
launch, column shards, the launch shapes, split-K and the switch; under the interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.backends import BackendUnavailableError
from kimi_helix.kernels.linear import linear, linear_ref
from kimi_helix.kernels.linear.triton import (
    MAX_ROWS,
    Tile,
    default_tile,
    linear_triton,
    split_count,
    split_plan,
    workspace,
)

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

pytestmark = pytest.mark.usefixtures("nan_empty")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("k", [40, 300], ids=["K40", "K300"])  # K300: a partial second BLOCK_K tile
def test_triton_matches_reference(dtype, rows, k):
    x, w = rnd(rows, k, seed=1, dtype=dtype), rnd(70, k, seed=2, dtype=dtype) / k**0.5
    y = linear_triton(x, w)
    assert y.dtype == dtype and y.shape == (rows, 70)
    assert_rel_close("y", y, linear_ref(x, w), TOL[dtype])


def test_several_weights_write_side_by_side():
    """q, k and v of one x in one launch, of unequal widths (tiles straddle no weight): the reference's concat."""
    x = rnd(2, 3, 48, seed=3)
    ws = [rnd(n, 48, seed=4 + n) for n in (40, 16, 72)]
    y = linear_triton(x, ws)
    assert y.shape == (2, 3, 128)
    assert_rel_close("y", y, linear_ref(x, ws), TOL[torch.float32])
    assert_rel_close("v part", y[..., 56:], linear_ref(x, ws[2]), TOL[torch.float32])


def test_column_shards_of_a_larger_weight():
    """A tensor-parallel column shard: rows strided by the full width."""
    x, full = rnd(2, 24, seed=17), rnd(40, 64, seed=18)
    w = full[:, 20:44]
    assert_rel_close("y", linear_triton(x, [w, full[:8, :24]]), linear_ref(x, [w, full[:8, :24]]), TOL[torch.float32])


def test_tiles_by_columns_and_every_tile_shape_is_exact():
    """Wide tiles once the columns give every SM more than one program (an H200's 132 SMs off the GPU); every
    launch shape the benchmark compares gives the reference's result, partial tiles included."""
    assert default_tile(3 * 4096, None) == Tile(64, 128) and default_tile(4096, None) == Tile(32, 256)
    x, w = rnd(3, 200, seed=15), rnd(50, 200, seed=16)
    for tile in (Tile(16, 64), Tile(32, 256), Tile(64, 128, num_warps=8, num_stages=2)):
        assert_rel_close(f"y {tile}", linear_triton(x, w, tile), linear_ref(x, w), TOL[torch.float32])


SPLIT_TILE = Tile(32, 64)  # short K steps, so K=300 splits 2, 3 or 5 ways (the last split ragged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_k_matches_reference(dtype, rows, splits):
    """K=300 in 2, 3 or 5 splits of 70 columns (a partial column tile); the counters are zero after the call."""
    assert split_plan(300, splits, SPLIT_TILE.block_k)[1] == splits
    x, w = rnd(rows, 300, seed=31, dtype=dtype), rnd(70, 300, seed=32, dtype=dtype) / 300**0.5
    y = linear_triton(x, w, SPLIT_TILE, splits)
    assert y.dtype == dtype and y.shape == (rows, 70)
    assert_rel_close("y", y, linear_ref(x, w), TOL[dtype])
    assert not workspace(x.device)[1].any(), "a ticket counter was left non-zero"


def test_split_k_several_weights_and_strided_rows():
    """Three weights in one split launch, one a column shard (rows strided by the full width), K not a multiple
    of BLOCK_K; two calls give the same bits."""
    x, full = rnd(5, 200, seed=33), rnd(40, 264, seed=34)
    ws = [full[:, 64:], rnd(16, 200, seed=35), rnd(72, 200, seed=36)]
    y = linear_triton(x, ws, SPLIT_TILE, 4)
    assert_rel_close("y", y, linear_ref(x, ws), TOL[torch.float32])
    assert torch.equal(y, linear_triton(x, ws, SPLIT_TILE, 4)), "split-K is not deterministic"
    assert not workspace(x.device)[1].any()


def test_split_plan_and_count():
    """Aligned split depths with no empty split; splits where the column tiles leave an H200's 132 SMs idle and
    the busiest SM's bytes drop by more than the overheads (KDA o_proj: 72 tiles, K=4096; f_a + g_a: 8, MLA kv_a:
    18, K=2304), none where the tiles fill the SMs, K is short (f_b: K=128) or a split saves too little (the
    shared experts' down: 72 tiles, K=1024); an automatic split launch gives the reference's result."""
    assert split_plan(300, 5, 128) == (128, 3) and split_plan(4096, 6, 256) == (768, 6)
    assert split_plan(40, 4, 64) == (64, 1)
    tile = Tile(32, 256)
    assert split_count(72, 4096, tile, 2, None) == 3
    assert split_count(8, 2304, tile, 2, None) == 5 and split_count(18, 2304, tile, 2, None) == 5
    assert split_count(72, 1024, tile, 2, None) == 1 and split_count(128, 128, tile, 2, None) == 1
    assert split_count(132, 4096, tile, 2, None) == 1 and split_count(8, 2304, Tile(128, 64), 2, None) == 1
    x, w = rnd(1, 1024, seed=37), rnd(40, 1024, seed=38)
    assert split_count(2, 1024, default_tile(40, None), 4, None) == 2
    y = linear_triton(x, w)
    assert_rel_close("auto split", y, linear_ref(x, w), TOL[torch.float32])
    assert not workspace(x.device)[1].any()


def test_switch_sends_more_rows_to_the_reference():
    x, w = rnd(MAX_ROWS + 1, 16, seed=5), rnd(8, 16, seed=6)
    with pytest.raises(BackendUnavailableError, match=f"rows={MAX_ROWS + 1} > {MAX_ROWS}"):
        linear(x, w, backend="triton")
    assert_rel_close("y", linear(x, w), linear_ref(x, w), TOL[torch.float32])
    assert_rel_close("y", linear(x[:3], w, backend="triton"), linear_ref(x[:3], w), TOL[torch.float32])


def test_bad_arguments_raise():
    x = rnd(2, 16, seed=7)
    with pytest.raises(ValueError, match=r"weights\[1\] must be an \[N, 16\]"):
        linear_triton(x, [rnd(4, 16, seed=8), rnd(4, 8, seed=9)])
    with pytest.raises(ValueError, match=r"weights\[0\] must be .* unit column stride"):
        linear_triton(x, rnd(16, 4, seed=10).t())
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        linear_triton(x, [])
    with pytest.raises(ValueError, match="at most 16"):
        linear_triton(rnd(MAX_ROWS + 1, 16, seed=11), rnd(4, 16, seed=12))
    with pytest.raises(ValueError, match="splits must be >= 1"):
        linear_triton(x, rnd(4, 16, seed=13), splits=0)
    cols = workspace(x.device)[0].numel() // MAX_ROWS  # more split columns than the workspace holds
    with pytest.raises(ValueError, match="splits=2 of .* exceed the split-K workspace"):
        linear_triton(rnd(1, 32, seed=14), torch.zeros(cols // 2 + 1, 32, device=DEVICE), Tile(64, 16), 2)
