"""Skinny `linear`: the Triton kernel against the torch reference, several weights in one launch, the switch."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.backends import BackendUnavailableError
from kimi_helix.kernels.linear import linear, linear_ref
from kimi_helix.kernels.linear.triton import MAX_ROWS, block_n, linear_triton

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


def test_column_tiles_fill_the_sms():
    assert block_n(4096, None) == 16 and block_n(132 * 128, None) == 128 and block_n(100, None) == 16


def test_switch_sends_more_rows_to_the_reference():
    x, w = rnd(MAX_ROWS + 1, 16, seed=5), rnd(8, 16, seed=6)
    with pytest.raises(BackendUnavailableError, match=f"rows={MAX_ROWS + 1} > {MAX_ROWS}"):
        linear(x, w, backend="triton")
    assert_rel_close("y", linear(x, w), linear_ref(x, w), TOL[torch.float32])
    assert_rel_close("y", linear(x[:3], w, backend="triton"), linear_ref(x[:3], w), TOL[torch.float32])


def test_bad_arguments_raise():
    x = rnd(2, 16, seed=7)
    with pytest.raises(ValueError, match=r"weights\[1\] must be a contiguous \[N, 16\]"):
        linear_triton(x, [rnd(4, 16, seed=8), rnd(4, 8, seed=9)])
    with pytest.raises(ValueError, match=r"weights\[0\] must be a contiguous"):
        linear_triton(x, rnd(16, 4, seed=10).t())
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        linear_triton(x, [])
    with pytest.raises(ValueError, match="at most 16"):
        linear_triton(rnd(MAX_ROWS + 1, 16, seed=11), rnd(4, 16, seed=12))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("n,k", [(4096, 2304), (2304, 4096), (576, 2304), (128, 2304), (4096, 128)])
def test_gpu_bf16_real_shapes(n, k):
    x, w = rnd(1, k, seed=13, dtype=torch.bfloat16), rnd(n, k, seed=14, dtype=torch.bfloat16) / k**0.5
    assert_rel_close("y", linear_triton(x, w), linear_ref(x.float(), w.float()), TOL[torch.bfloat16])
