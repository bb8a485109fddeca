"""The KDA rollback from device counts: the Triton kernel against `restore_verified_states_ref` (copies, so
exactly), and the reference against a per-layer, per-group loop written from the op's definition. Slots not
restored must keep their (NaN-poisoned) values."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.state_restore import restore_verified_states, restore_verified_states_ref
from kimi_helix.kernels.state_restore.triton import restore_verified_states_triton

from ..conftest import DEVICE, rnd

L, S, H, K, W1, C = 2, 6, 4, 32, 3, 40  # a state of 4096 values spans 4 of the kernel's blocks; W - 1 = 3 rows


def _case(n: int, group: int, conv_dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pools = (torch.full((L, S, H, K, K), float("nan"), device=DEVICE),
             torch.full((L, S, W1, C), float("nan"), device=DEVICE, dtype=conv_dtype))  # fmt: skip
    rows = n * group + 3  # the scratch holds more rows than the step used
    states = rnd(L, rows, H, K, K, seed=seed)
    inputs = rnd(L, rows, C, seed=seed + 1, dtype=conv_dtype)
    conv_before = rnd(L, n + 2, W1, C, seed=seed + 2, dtype=conv_dtype)
    slots = torch.randperm(S, generator=gen)[:n].to(DEVICE)
    accepted = torch.tensor([(seed + i) % group for i in range(n)], device=DEVICE)
    return pools, (states, inputs, conv_before, slots, accepted, group)


def _run(fn, case):
    (rec, conv), args = case
    rec, conv = rec.clone(), conv.clone()
    fn(rec, conv, *args)
    return rec, conv


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,group", [(1, 2), (3, 6), (4, 9)], ids=lambda v: str(v))
def test_triton_matches_reference(n, group, conv_dtype):
    case = _case(n, group, conv_dtype, seed=n + group)
    want, got = _run(restore_verified_states_ref, case), _run(restore_verified_states_triton, case)
    for w, r in zip(want, got):
        assert torch.equal(w.isnan(), r.isnan()) and torch.equal(w.nan_to_num(), r.nan_to_num())


def test_reference_follows_the_definition():
    """Slot s_i of every layer: the recurrent state after token a_i of group i, and the W - 1 conv inputs ending
    at that token (reaching back into the conv state before the group when a_i + 1 < W - 1)."""
    n, group = 3, 6
    case = _case(n, group, torch.float32, seed=5)
    rec, conv = _run(restore_verified_states, case)
    states, inputs, conv_before, slots, accepted, _ = case[1]
    for layer in range(L):
        for i, (slot, a) in enumerate(zip(slots.tolist(), accepted.tolist())):
            assert torch.equal(rec[layer, slot], states[layer, i * group + a])
            history = [conv_before[layer, i, r] for r in range(W1)]
            history += [inputs[layer, i * group + t] for t in range(a + 1)]
            assert torch.equal(conv[layer, slot], torch.stack(history[-W1:]))
    others = [s for s in range(S) if s not in slots.tolist()]
    assert rec[:, others].isnan().all() and conv[:, others].isnan().all()


def _scattered(conv_dtype, seed: int):
    """Three groups of 5 tokens taken out of order from a scratch of four, with their rows (`scratch_at`), as the
    engine's synchronous rollback passes the groups that rejected a draft."""
    (pools, (states, inputs, conv_before, _, _, group)) = _case(4, 5, conv_dtype, seed=seed)
    picked = [2, 0, 3]
    at = torch.tensor([[g * group, g] for g in picked], device=DEVICE)
    slots, accepted = torch.tensor([4, 1, 5], device=DEVICE), torch.tensor([0, 4, 2], device=DEVICE)
    return pools, (states, inputs, conv_before, slots, accepted, group, at)


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference_at_given_scratch_rows(conv_dtype):
    case = _scattered(conv_dtype, seed=7)
    want, got = _run(restore_verified_states_ref, case), _run(restore_verified_states_triton, case)
    for w, r in zip(want, got):
        assert torch.equal(w.isnan(), r.isnan()) and torch.equal(w.nan_to_num(), r.nan_to_num())


def test_given_scratch_rows_follow_the_definition():
    case = _scattered(torch.float32, seed=3)
    rec, conv = _run(restore_verified_states, case)
    states, inputs, conv_before, slots, accepted, _, at = case[1]
    for layer in range(L):
        for slot, a, (first, seq) in zip(slots.tolist(), accepted.tolist(), at.tolist()):
            assert torch.equal(rec[layer, slot], states[layer, first + a])
            history = [conv_before[layer, seq, r] for r in range(W1)] + [inputs[layer, first + t] for t in range(a + 1)]
            assert torch.equal(conv[layer, slot], torch.stack(history[-W1:]))
    others = [s for s in range(S) if s not in slots.tolist()]
    assert rec[:, others].isnan().all() and conv[:, others].isnan().all()


def test_accepted_may_be_a_strided_view():
    """The engine passes the accepted counts as a column of its verdict buffer [N, G + 1]."""
    (pools, (states, inputs, conv_before, slots, accepted, group)) = _case(3, 5, torch.float32, seed=2)
    verdict = torch.zeros(3, group + 1, dtype=torch.int64, device=DEVICE)
    verdict[:, group] = accepted
    case = (pools, (states, inputs, conv_before, slots, verdict[:, group], group))
    want, got = _run(restore_verified_states_ref, case), _run(restore_verified_states_triton, case)
    assert all(torch.equal(w.nan_to_num(), r.nan_to_num()) for w, r in zip(want, got))


def test_mismatched_shapes_are_refused():
    (rec, conv), (states, inputs, conv_before, slots, accepted, group) = _case(2, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="inputs must be"):
        restore_verified_states_ref(rec, conv, states, inputs[:, :, :-1], conv_before, slots, accepted, group)
    with pytest.raises(ValueError, match="accepted must be int64"):
        restore_verified_states_triton(rec, conv, states, inputs, conv_before, slots, accepted.int(), group)
    at = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"scratch_at must be int64 \[N=2, 2\]"):
        restore_verified_states_ref(rec, conv, states, inputs, conv_before, slots, accepted, group, at[:, :1])
    with pytest.raises(ValueError, match="scratch_at must be contiguous"):
        strided = torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)[:, :2]
        restore_verified_states_triton(rec, conv, states, inputs, conv_before, slots, accepted, group, strided)
