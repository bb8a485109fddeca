"""Greedy DSpark Markov chain: the Triton kernel against `markov_chain_greedy_ref` (tokens exactly, confidences to
rounding), and the reference against the drafter's former loop written out in plain torch ops."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.markov import markov_chain_greedy, markov_chain_greedy_ref
from kimi_helix.kernels.markov import triton as markov_triton
from kimi_helix.kernels.markov.triton import markov_chain_greedy_triton

from ..conftest import DEVICE, TOL, assert_rel_close, rnd

# V spans 12 W2 tiles of the kernel at r = 32 (BLOCK_V = 128), one a vocabulary split, so the argmax crosses
# tiles and splits
V, R, D = 1500, 32, 48
# ids whose W2 rows are equal and whose base logits tie on some slots: within a tile (600, 610) and across tiles
TIES = {1: [1200, 610, 600], 2: [1200, 37]}  # slot % 3 -> tied ids; the lowest must win
TIED_ROWS = [37, 600, 610, 1200]


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty fills floats with NaN and integers with -1, so an output the kernel never writes cannot pass."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)

    monkeypatch.setattr(torch, "empty", poisoned)


def _inputs(n, k, seed, dtype, conf=True, ties=True):
    base = rnd(n, k, V, seed=seed)
    w1 = rnd(V, R, seed=seed + 1, dtype=dtype)
    w2 = (rnd(V, R, seed=seed + 2) * 0.3).to(dtype)
    if ties:
        w2[TIED_ROWS] = w2[TIED_ROWS[0]].clone()
        for slot in range(k):
            if slot % 3 in TIES:
                base[:, slot, TIES[slot % 3]] = 50.0  # above any random logit plus bias
    # a column of a larger tensor, as the drafter's anchors may be (strided)
    anchors = torch.randint(0, V, (n, 2), generator=torch.Generator().manual_seed(seed)).to(DEVICE)[:, 1]
    if not conf:
        return base, anchors, w1, w2, None, None, None
    hidden = rnd(n, k + 1, D, seed=seed + 3, dtype=dtype)[:, :k]  # a slice, as the drafter's (strided rows)
    conf_weight = (rnd(D + R, seed=seed + 4) * 0.2).to(dtype)
    return base, anchors, w1, w2, hidden, conf_weight, rnd(1, seed=seed + 5, dtype=dtype)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("conf", [True, False], ids=["conf", "no_conf"])
@pytest.mark.parametrize("k", [1, 5, 7], ids=["K1", "K5", "K7"])
@pytest.mark.parametrize("n", [1, 3], ids=["N1", "N3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference(dtype, n, k, conf):
    args = _inputs(n, k, seed=10 * n + k, dtype=dtype, conf=conf)
    tokens, confidence = markov_chain_greedy_triton(*args)
    ref_tokens, ref_conf = markov_chain_greedy_ref(*args)
    assert tokens.dtype == torch.int64 and tokens.shape == (n, k)
    assert torch.equal(tokens, ref_tokens)
    for slot in range(k):
        if slot % 3 in TIES:
            assert (tokens[:, slot] == min(TIES[slot % 3])).all()
    if conf:
        assert confidence.dtype == torch.float32
        assert_rel_close("confidence", confidence, ref_conf, TOL[torch.float32])
    else:
        assert confidence is None and ref_conf is None


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("fn", [markov_chain_greedy_ref, markov_chain_greedy_triton], ids=["torch", "triton"])
def test_half_base_is_read_as_fp32(fn):
    """The LM head's fp16 logits go in as they are (no cast kernel): the result is the chain on their exact fp32
    widening."""
    base, *rest = _inputs(3, 5, seed=11, dtype=torch.float16)
    half = base.half()
    tokens, confidence = fn(half, *rest)
    want_tokens, want_conf = markov_chain_greedy_ref(half.float(), *rest)
    assert torch.equal(tokens, want_tokens)
    assert_rel_close("confidence", confidence, want_conf, TOL[torch.float32])


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("max_splits", [1, 2, 5])
def test_triton_matches_reference_with_several_tiles_a_split(max_splits, monkeypatch):
    """Fewer vocabulary splits than W2 tiles (12 at V = 1500): each program loops over several tiles, and tied
    ids fall in one split or across splits; a row of -inf logits gives id 0, as torch.argmax does."""
    monkeypatch.setattr(markov_triton, "MAX_SPLITS", max_splits)
    args = _inputs(2, 5, seed=max_splits, dtype=torch.float32)
    args[0][1, 3] = float("-inf")
    tokens, confidence = markov_chain_greedy_triton(*args)
    ref_tokens, ref_conf = markov_chain_greedy_ref(*args)
    assert torch.equal(tokens, ref_tokens) and tokens[1, 3] == 0
    assert_rel_close("confidence", confidence, ref_conf, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_drafters_loop(dtype):
    """The former `DSparkDrafter.draft` greedy loop, slot by slot: nn.Embedding W1, nn.Linear W2 in the weights'
    dtype, fp32 add, argmax; then the confidence head Linear(d + r, 1) on [h_k; W1[prev_k]], float, sigmoid."""
    n, k = 3, 5
    base, anchors, w1, w2, hidden, conf_weight, conf_bias = _inputs(n, k, seed=3, dtype=dtype)
    embed = torch.nn.Embedding(V, R, _weight=w1)
    proj = torch.nn.Linear(R, V, bias=False, dtype=dtype, device=DEVICE)
    head = torch.nn.Linear(D + R, 1, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        proj.weight.copy_(w2)
        head.weight.copy_(conf_weight[None])
        head.bias.copy_(conf_bias)
        prev, expected = anchors, []
        for slot in range(k):
            expected.append(torch.argmax(base[:, slot] + proj(embed(prev)).float(), dim=-1))
            prev = expected[-1]
        expected = torch.stack(expected, dim=1)
        prevs = torch.cat([anchors[:, None], expected[:, :-1]], dim=1)
        expected_conf = torch.sigmoid(head(torch.cat([hidden, embed(prevs)], -1)).squeeze(-1).float())
        tokens, confidence = markov_chain_greedy_ref(base, anchors, w1, w2, hidden, conf_weight, conf_bias)
    assert torch.equal(tokens, expected)
    assert torch.equal(confidence, expected_conf)


def test_switch_dispatches_and_both_backends_agree():
    args = _inputs(3, 4, seed=7, dtype=torch.float32)
    ref = markov_chain_greedy(*args, backend="torch")
    out = markov_chain_greedy(*args, backend="triton")
    assert torch.equal(out[0], ref[0])
    assert_rel_close("confidence", out[1], ref[1], TOL[torch.float32])


def test_nan_logits_still_give_valid_token_ids():
    """A CUDA graph's padding rows may carry garbage; their tokens feed the next slot's W1 gather, so they must
    stay valid ids."""
    base, anchors, w1, w2, *_ = _inputs(3, 5, seed=8, dtype=torch.float32, conf=False, ties=False)
    base[1] = float("nan")
    tokens, _ = markov_chain_greedy_triton(base, anchors, w1, w2)
    assert ((tokens >= 0) & (tokens < V)).all()


def test_bad_arguments_raise():
    base, anchors, w1, w2, hidden, conf_weight, conf_bias = _inputs(2, 3, seed=9, dtype=torch.float32)
    for fn in (markov_chain_greedy_ref, markov_chain_greedy_triton):
        with pytest.raises(ValueError, match="base must be fp32/fp16/bf16"):
            fn(base.double(), anchors, w1, w2)
        with pytest.raises(ValueError, match="anchor_ids must be int64"):
            fn(base, anchors.int(), w1, w2)
        with pytest.raises(ValueError, match="w1 and w2"):
            fn(base, anchors, w1, w2[:, :-1])
        with pytest.raises(ValueError, match="given together"):
            fn(base, anchors, w1, w2, hidden, conf_weight, None)
        with pytest.raises(ValueError, match="conf_weight"):
            fn(base, anchors, w1, w2, hidden, conf_weight[:-1], conf_bias)
        with pytest.raises(ValueError, match="w1 and w2"):
            fn(base, anchors, w1[:-1], w2[:-1])
