"""CONV: the torch references against independent oracles (dense softmax, transformers, loops)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from kimi_helix.kernels.conv import causal_conv1d, causal_conv1d_update

from ..conftest import assert_rel_close

# The decorated HF functions dispatch to causal-conv1d when installed; unwrap to always compare to their torch code.
hf_conv_fn = inspect.unwrap(hf.causal_conv1d_fn)


hf_conv_update = inspect.unwrap(hf.causal_conv1d_update)


D, W = 12, 4


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def conv_oracle(x, weight, state=None, activation="silu"):
    """F.conv1d over concat(state or zeros, x) with no padding: x [B,T,D], weight [D,W], state [B,W-1,D]."""
    B, T, _ = x.shape
    w = weight.shape[1]
    if state is None:
        state = torch.zeros(B, w - 1, x.shape[2])
    xs = torch.cat([state.double(), x.double()], dim=1).transpose(1, 2)
    y = F.conv1d(xs, weight.double().unsqueeze(1), groups=x.shape[2]).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("T", [1, 2, 7])
@pytest.mark.parametrize("activation", ["silu", None])
def test_matches_padded_conv(T, activation):
    x, w = rand(2, T, D, seed=T), rand(D, W, seed=100)
    y, s = causal_conv1d(x, w, activation=activation)
    assert s is None and y.dtype == x.dtype
    padded = F.pad(x.transpose(1, 2), (W - 1, 0))
    expected = F.conv1d(padded, w.unsqueeze(1), groups=D).transpose(1, 2)
    expected = F.silu(expected) if activation == "silu" else expected
    assert_rel_close("y", y, expected, 1e-6)
    # the transformers torch path uses the [B, D, T] layout
    hf_y = hf_conv_fn(x.transpose(1, 2), w, activation=activation).transpose(1, 2)
    assert_rel_close("y vs transformers", y, hf_y, 1e-6)


@pytest.mark.parametrize("T", [1, 2, 9])
def test_initial_state(T):
    x, w, s0 = rand(3, T, D, seed=1), rand(D, W, seed=2), rand(3, W - 1, D, seed=3)
    y, s = causal_conv1d(x, w, initial_state=s0, output_final_state=True)
    assert_rel_close("y", y, conv_oracle(x, w, s0), 1e-6)
    expected_state = torch.cat([s0, x], dim=1)[:, -(W - 1) :]  # short sequences keep the tail of s0
    assert s.dtype == x.dtype and torch.equal(s, expected_state)


def test_final_state_short_sequence_without_state():
    x, w = rand(2, 1, D, seed=4), rand(D, W, seed=5)
    _, s = causal_conv1d(x, w, output_final_state=True)
    assert torch.equal(s[:, : W - 2], torch.zeros(2, W - 2, D))
    assert torch.equal(s[:, -1], x[:, 0])


def test_varlen_equals_separate():
    lens = [1, 6, 2, 0, 5]
    x, w = rand(1, sum(lens), D, seed=6), rand(D, W, seed=7)
    s0 = rand(len(lens), W - 1, D, seed=8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for init in (None, s0):
        y, s = causal_conv1d(x, w, initial_state=init, output_final_state=True, cu_seqlens=cu)
        assert y.shape == x.shape and s.shape == (len(lens), W - 1, D)
        for n in range(len(lens)):
            a, b = cu[n].item(), cu[n + 1].item()
            st = None if init is None else init[n : n + 1]
            y_n, s_n = causal_conv1d(x[:, a:b], w, initial_state=st, output_final_state=True)
            assert_rel_close(f"y of sequence {n}", y[:, a:b], y_n, 1e-6)
            assert torch.equal(s[n : n + 1], s_n), f"state of sequence {n}"
    assert torch.equal(s[3], s0[3])  # an empty sequence passes its state through


@pytest.mark.parametrize("activation", ["silu", None])
def test_prefill_then_update(activation):
    T, P = 10, 4
    x, w, s0 = rand(2, T, D, seed=9), rand(D, W, seed=10), rand(2, W - 1, D, seed=11)
    y_full, s_full = causal_conv1d(x, w, initial_state=s0, output_final_state=True, activation=activation)
    y_pre, state = causal_conv1d(x[:, :P], w, initial_state=s0, output_final_state=True, activation=activation)
    ys = [y_pre]
    buf = state  # updated in place
    for t in range(P, T):
        y_t = causal_conv1d_update(x[:, t], buf, w, activation=activation)
        assert y_t.shape == (2, D)
        ys.append(y_t.unsqueeze(1))
    assert buf is state
    assert_rel_close("y", torch.cat(ys, dim=1), y_full, 1e-6)
    assert torch.equal(state, s_full)


def test_update_matches_transformers():
    # transformers caches the last W inputs as [N, D, W]; only the newest W - 1 matter for the next output
    x, w, hf_state = rand(3, D, seed=12), rand(D, W, seed=13), rand(3, D, W, seed=14)
    state = hf_state[:, :, 1:].transpose(1, 2).contiguous()
    y = causal_conv1d_update(x, state, w)
    hf_y = hf_conv_update(x.unsqueeze(-1), hf_state, w, activation="silu").squeeze(-1)
    assert_rel_close("y", y, hf_y, 1e-6)
    assert torch.equal(state, hf_state[:, :, 1:].transpose(1, 2))


def test_low_precision_dtype():
    x, w, s0 = rand(2, 5, D, seed=15).bfloat16(), rand(D, W, seed=16), rand(2, W - 1, D, seed=17).bfloat16()
    y, s = causal_conv1d(x, w, initial_state=s0, output_final_state=True)
    assert y.dtype == s.dtype == torch.bfloat16
    assert_rel_close("y bf16", y, conv_oracle(x.float(), w, s0.float()), 1e-2)
    buf = s0.clone()
    y1 = causal_conv1d_update(x[:, 0], buf, w)
    assert y1.dtype == torch.bfloat16 and torch.equal(buf[:, -1], x[:, 0])


def test_width_one():
    x, w = rand(1, 3, D, seed=18), rand(D, 1, seed=19)
    y, s = causal_conv1d(x, w, output_final_state=True, cu_seqlens=torch.tensor([0, 1, 3]))
    assert s.shape == (2, 0, D)
    assert_rel_close("y", y, F.silu(x * w[:, 0]), 1e-6)


def test_bad_inputs_raise():
    x, w, s0 = rand(2, 5, D), rand(D, W), rand(2, W - 1, D)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w.T)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w.unsqueeze(1))
    with pytest.raises(ValueError, match="x must"):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, w, initial_state=s0.transpose(1, 2))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x[:1], w, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x[:, 0], s0[:, 1:], w)
    with pytest.raises(ValueError, match="x must"):
        causal_conv1d_update(x[:, :1], s0, w)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_update(x[:, 0], s0, w[:-1])


def test_state_pool_by_slot_index():
    """With state_indices the references read and update a conv-state pool in place, as the Triton kernels do."""
    x, weight = rand(1, 9, D, seed=21), rand(D, W, seed=22)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    pool, slots = rand(5, W - 1, D, seed=23), torch.tensor([3, 1])
    before = pool.clone()
    y_ref, final_ref = causal_conv1d(x, weight, pool[slots].clone(), True, cu)
    y, returned = causal_conv1d(x, weight, pool, True, cu, state_indices=slots)
    assert returned is pool and torch.equal(y, y_ref) and torch.equal(pool[slots], final_ref)
    assert torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])

    step = rand(2, D, seed=24)
    expected_state = pool[slots].clone()
    y_ref = causal_conv1d_update(step, expected_state, weight)
    assert torch.equal(causal_conv1d_update(step, pool, weight, state_indices=slots), y_ref)
    assert torch.equal(pool[slots], expected_state) and torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])


@pytest.mark.parametrize("pooled", [False, True], ids=["dense", "pool"])
def test_records(pooled):
    """record_into holds the states the sequences read before the call (the pool rows, before they are
    overwritten) and the raw inputs of the channel groups concatenated; y and the final states are unchanged."""
    lens, D3 = [1, 6, 2, 0, 5], 3 * D
    xs, ws = [rand(1, sum(lens), D, seed=30 + i) for i in range(3)], [rand(D, W, seed=33 + i) for i in range(3)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    slots = torch.tensor([4, 0, 6, 2, 5]) if pooled else None
    state = rand(7 if pooled else len(lens), W - 1, D3, seed=36)
    records = (torch.full((len(lens), W - 1, D3), float("nan")), torch.full((sum(lens), D3), float("nan")))
    y, final = causal_conv1d(xs, ws, state.clone(), True, cu, state_indices=slots, record_into=records)
    assert torch.equal(records[0], state if slots is None else state[slots])
    assert torch.equal(records[1], torch.cat(xs, -1)[0])
    y_plain, final_plain = causal_conv1d(xs, ws, state.clone(), True, cu, state_indices=slots)
    assert torch.equal(y, y_plain) and torch.equal(final, final_plain)
