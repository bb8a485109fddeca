"""CONV: the Triton kernels against the torch references, on the CPU interpreter or a GPU."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.conv import causal_conv1d, causal_conv1d_update
from kimi_helix.kernels.conv.triton import causal_conv1d_triton, causal_conv1d_update_triton

from ..conftest import DEVICE, TOL, assert_rel_close, rnd
from .conftest import D, W, cu

pytestmark = pytest.mark.usefixtures("nan_empty")


LENS = [3, 1, 9, 0, 2, 20]  # shorter than W - 1, empty, and longer than a token block


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "state"])
@pytest.mark.parametrize("activation", ["silu", None])
def test_matches_naive(dtype, varlen, with_state, activation):
    B, T = (1, sum(LENS)) if varlen else (2, 7)
    N = len(LENS) if varlen else B
    x, w = rnd(B, T, D, seed=1, dtype=dtype), rnd(D, W, seed=2, dtype=dtype)
    kw = dict(
        initial_state=rnd(N, W - 1, D, seed=3, dtype=dtype) if with_state else None,
        output_final_state=True,
        cu_seqlens=cu(LENS) if varlen else None,
        activation=activation,
    )
    y, s = causal_conv1d_triton(x, w, **kw)
    y_ref, s_ref = causal_conv1d(x, w, **kw)
    assert y.dtype == s.dtype == dtype
    assert_rel_close("y", y, y_ref, TOL[dtype])
    assert torch.equal(s, s_ref), "the final cache is a copy of inputs: it must be exact"


@pytest.mark.parametrize("width", [1, 2, 3])
def test_other_widths(width):
    x, w = rnd(1, sum(LENS), D, seed=4), rnd(D, width, seed=5)
    kw = dict(initial_state=rnd(len(LENS), width - 1, D, seed=6), output_final_state=True, cu_seqlens=cu(LENS))
    y, s = causal_conv1d_triton(x, w, **kw)
    y_ref, s_ref = causal_conv1d(x, w, **kw)
    assert_rel_close("y", y, y_ref, 1e-5)
    assert torch.equal(s, s_ref)
    state = rnd(3, width - 1, D, seed=7)
    state_ref = state.clone()
    x1 = rnd(3, D, seed=8)
    assert_rel_close(
        "update y", causal_conv1d_update_triton(x1, state, w), causal_conv1d_update(x1, state_ref, w), 1e-5
    )
    assert torch.equal(state, state_ref)


@pytest.mark.parametrize("output_final_state", [False, True])
def test_state_pool_in_place(output_final_state):
    lens, slots = [4, 1, 6], torch.tensor([5, 0, 2], device=DEVICE, dtype=torch.int32)
    x, w = rnd(1, sum(lens), D, seed=9), rnd(D, W, seed=10)
    pool = rnd(7, W - 1, D, seed=11)
    before = pool.clone()
    y, ret = causal_conv1d_triton(
        x, w, initial_state=pool, output_final_state=output_final_state, cu_seqlens=cu(lens), state_indices=slots
    )
    y_ref, s_ref = causal_conv1d(x, w, initial_state=before[slots], output_final_state=True, cu_seqlens=cu(lens))
    assert_rel_close("y", y, y_ref, 1e-5)
    untouched = [i for i in range(7) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    if output_final_state:
        assert ret is pool and torch.equal(pool[slots], s_ref)
    else:
        assert ret is None and torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooled", [False, True], ids=["dense", "pool"])
def test_update_matches_naive(dtype, pooled):
    N, w, x = 3, rnd(D, W, seed=12, dtype=dtype), rnd(3, D, seed=13, dtype=dtype)
    slots = torch.tensor([4, 1, 2], device=DEVICE) if pooled else None
    state = rnd(6 if pooled else N, W - 1, D, seed=14, dtype=dtype)
    before = state.clone()
    y = causal_conv1d_update_triton(x, state, w, state_indices=slots)
    rows = slots if pooled else torch.arange(N, device=DEVICE)
    dense = before[rows].clone()
    y_ref = causal_conv1d_update(x, dense, w)
    assert_rel_close("y", y, y_ref, TOL[dtype])
    assert torch.equal(state[rows], dense)
    if pooled:
        assert torch.equal(state[[0, 3, 5]], before[[0, 3, 5]])


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("pooled", [False, True], ids=["dense", "pool"])
def test_update_channel_groups_equal_concatenation(groups, pooled):
    """q, k and v as separate inputs and weights (strided, as slices of wider projections) give the conv of their
    concatenation, and the state of the concatenated channels."""
    N = 3
    wide = rnd(N, groups, D + 8, seed=30)
    xs = [wide[:, i, :D] for i in range(groups)]
    ws = [rnd(D, W, seed=31 + i) for i in range(groups)]
    slots = torch.tensor([4, 1, 2], device=DEVICE) if pooled else None
    state = rnd(6 if pooled else N, W - 1, groups * D, seed=35)
    before = state.clone()
    y = causal_conv1d_update_triton(xs, state, ws, state_indices=slots)
    rows = slots if pooled else torch.arange(N, device=DEVICE)
    dense = before[rows].clone()
    y_ref = causal_conv1d_update(torch.cat(xs, -1), dense, torch.cat(ws))
    assert_rel_close("y", y, y_ref, 1e-5)
    assert torch.equal(state[rows], dense)
    y_naive = causal_conv1d_update(xs, before[rows].clone(), ws)
    assert torch.equal(y_naive, y_ref)


@pytest.mark.parametrize("pooled", [False, True], ids=["batch", "varlen_pool"])
def test_prefill_channel_groups_equal_concatenation(pooled):
    """q, k, v as channel groups (strided slices) of a prefill or verify conv: the conv of their concatenation,
    the cache of the concatenated channels."""
    B, T = (1, sum(LENS)) if pooled else (2, 7)
    wide = rnd(B, T, 3, D + 8, seed=40)
    xs, ws = [wide[:, :, i, :D] for i in range(3)], [rnd(D, W, seed=43 + i) for i in range(3)]
    slots = torch.tensor([7, 0, 3, 5, 1, 2], device=DEVICE) if pooled else None
    pool = rnd(8, W - 1, 3 * D, seed=46) if pooled else None
    before = pool.clone() if pooled else None
    kw = dict(output_final_state=True, cu_seqlens=cu(LENS) if pooled else None)
    y, s = causal_conv1d_triton(xs, ws, initial_state=pool, state_indices=slots, **kw)
    x_cat, w_cat = torch.cat(xs, -1), torch.cat(ws)
    y_ref, s_ref = causal_conv1d(x_cat, w_cat, initial_state=before[slots] if pooled else None, **kw)
    assert_rel_close("y", y, y_ref, 1e-5)
    assert torch.equal(s[slots] if pooled else s, s_ref)
    if pooled:
        assert torch.equal(pool[[4, 6]], before[[4, 6]])


@pytest.mark.parametrize("record", [False, True], ids=["plain", "records"])
@pytest.mark.parametrize("groups", [1, 3])
def test_split_output_equals_the_concatenated_output(groups, record):
    """split_output: one contiguous [B, T, P] tensor per channel group (planes of a NaN-filled buffer, so a plane
    left unwritten or written at a wrong offset fails), each equal to its channels of the concatenated output; the
    final states and records are unchanged; the reference splits the same way."""
    B, T, N = 1, sum(LENS), len(LENS)
    wide = rnd(B, T, 3, D + 8, seed=60)
    xs, ws = [wide[:, :, i, :D] for i in range(groups)], [rnd(D, W, seed=61 + i) for i in range(groups)]
    slots = torch.tensor([7, 0, 3, 5, 1, 2], device=DEVICE)
    state = rnd(8, W - 1, groups * D, seed=64)
    outs = []
    for fn, split in ((causal_conv1d_triton, True), (causal_conv1d_triton, False), (causal_conv1d, True)):
        records = (_nans(N, W - 1, groups * D, dtype=torch.float32), _nans(B * T, groups * D, dtype=torch.float32))
        y, final = fn(xs, ws, state.clone(), True, cu(LENS), state_indices=slots,
                      record_into=records if record else None, split_output=split)  # fmt: skip
        outs.append((y, final, *records))
    (parts, final, *recs), (y, final_cat, *recs_cat), (parts_ref, _, *_) = outs
    assert isinstance(parts, tuple) and len(parts) == len(parts_ref) == groups
    for i, (part, part_ref) in enumerate(zip(parts, parts_ref)):
        assert part.shape == (B, T, D) and part.is_contiguous() and part_ref.is_contiguous()
        assert torch.equal(part, y[..., i * D : (i + 1) * D])
        assert_rel_close(f"group {i}", part, part_ref, 1e-5)
    assert torch.equal(final, final_cat)
    if record:
        assert all(torch.equal(a, b) for a, b in zip(recs, recs_cat))


def _nans(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooled", [False, True], ids=["dense", "pool"])
@pytest.mark.parametrize("width", [1, 2, W])
def test_records_match_naive(dtype, pooled, width):
    """record_into of a varlen call over q, k, v channel groups (strided slices): the states before the call and
    the raw inputs equal the reference's exactly (NaN-filled buffers, so an entry left unwritten fails), and
    recording changes neither y nor the final states."""
    B, T, N = 1, sum(LENS), len(LENS)  # sequences shorter than W - 1, empty, and longer than a token block
    wide = rnd(B, T, 3, D + 8, seed=50, dtype=dtype)
    xs, ws = [wide[:, :, i, :D] for i in range(3)], [rnd(D, width, seed=51 + i, dtype=dtype) for i in range(3)]
    slots = torch.tensor([7, 0, 3, 5, 1, 2], device=DEVICE) if pooled else None
    state = rnd(8 if pooled else N, width - 1, 3 * D, seed=54, dtype=dtype)
    outs = []
    for fn in (causal_conv1d_triton, causal_conv1d):
        records = (_nans(N, width - 1, 3 * D, dtype=dtype), _nans(B * T, 3 * D, dtype=dtype))
        pool = state.clone()
        y, final = fn(xs, ws, pool, True, cu(LENS), state_indices=slots, record_into=records)
        outs.append((y, final.clone(), *records))
    (y, final, before, inputs), (y_ref, final_ref, before_ref, inputs_ref) = outs
    assert torch.equal(before, before_ref) and torch.equal(inputs, inputs_ref)
    y_plain, final_plain = causal_conv1d_triton(xs, ws, state.clone(), True, cu(LENS), state_indices=slots)
    assert torch.equal(y, y_plain) and torch.equal(final, final_plain)
    assert_rel_close("y", y, y_ref, TOL[dtype])
    assert torch.equal(final, final_ref)


def test_records_need_state_and_final_state():
    x, w, s = rnd(1, 5, D, seed=60), rnd(D, W, seed=61), rnd(2, W - 1, D, seed=62)
    records = (torch.empty(2, W - 1, D, device=DEVICE), torch.empty(5, D, device=DEVICE))
    for fn in (causal_conv1d_triton, causal_conv1d):
        with pytest.raises(ValueError, match="output_final_state"):
            fn(x, w, s, False, cu([2, 3]), record_into=records)
        with pytest.raises(ValueError, match="initial_state"):
            fn(x, w, None, True, cu([2, 3]), record_into=records)
        with pytest.raises(ValueError, match="record_into's inputs"):
            fn(x, w, s, True, cu([2, 3]), record_into=(records[0], records[1][:4]))
        with pytest.raises(ValueError, match="record_into's conv_before"):
            fn(x, w, s, True, cu([2, 3]), record_into=(records[0][:1], records[1]))


def test_prefill_then_decode():
    T = 9
    x, w = rnd(2, T, D, seed=15), rnd(D, W, seed=16)
    s0 = rnd(2, W - 1, D, seed=17)
    y_full, s_full = causal_conv1d(x, w, initial_state=s0, output_final_state=True)
    P = T - 5
    y_pre, s = causal_conv1d_triton(x[:, :P], w, initial_state=s0, output_final_state=True)
    ys = [y_pre] + [causal_conv1d_update_triton(x[:, t], s, w)[:, None] for t in range(P, T)]
    assert_rel_close("y", torch.cat(ys, dim=1), y_full, 1e-5)
    assert torch.equal(s, s_full)


def test_strided_input():
    """x sliced out of a wider projection (token stride > D) is read in place."""
    wide = rnd(2, 5, 2 * D, seed=18)
    x, w = wide[..., :D], rnd(D, W, seed=19)
    y, _ = causal_conv1d_triton(x, w)
    y_ref, _ = causal_conv1d(x, w)
    assert_rel_close("y", y, y_ref, 1e-5)
    s = rnd(2, W - 1, D, seed=20)
    s_ref = s.clone()
    assert_rel_close(
        "update", causal_conv1d_update_triton(wide[:, 0, :D], s, w), causal_conv1d_update(x[:, 0], s_ref, w), 1e-5
    )


def test_bad_arguments_raise():
    x, w = rnd(2, 3, D, seed=21), rnd(D, W, seed=22)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_triton(x, w[:-1])
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_triton(x, w, activation="relu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_triton(x, w, initial_state=rnd(3, W - 1, D, seed=0))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_triton(x, w, cu_seqlens=cu([3, 3]))
    with pytest.raises(ValueError, match="pool"):
        causal_conv1d_triton(x, w, state_indices=torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="state_indices"):
        causal_conv1d_update_triton(x[:, 0], rnd(4, W - 1, D, seed=0), w, state_indices=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update_triton(x[:, 0], rnd(3, W - 1, D, seed=0), w)
    s = rnd(2, W - 1, 2 * D, seed=0)
    with pytest.raises(ValueError, match="as many channel groups"):
        causal_conv1d_update_triton([x[:, 0], x[:, 1]], s, [w])
    with pytest.raises(ValueError, match="one shape"):
        causal_conv1d_update_triton([x[:, 0], x[:, 1, :-1]], s, [w, w])
    with pytest.raises(ValueError, match="at most 3"):
        causal_conv1d_update_triton([x[:, 0]] * 4, rnd(2, W - 1, 4 * D, seed=0), [w] * 4)
