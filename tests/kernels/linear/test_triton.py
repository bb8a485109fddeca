"""Skinny `linear`: the Triton kernel against the torch reference (`F.linear`, per weight), several weights in one
launch, column shards, the launch shapes and the switch; under the interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.backends import BackendUnavailableError
from kimi_helix.kernels.linear import linear, linear_ref
from kimi_helix.kernels.linear.triton import MAX_ROWS, Tile, default_tile, linear_triton

from ..conftest import TOL, assert_rel_close, rnd

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
