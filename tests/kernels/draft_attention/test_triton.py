"""Draft attention: the Triton kernel against `draft_attention_ref` (fp32, fp16; bf16 in test_gpu.py), with every
cache row no request sees poisoned with NaN; argument checks and the switch."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.backends import BackendUnavailableError, OpRequest, select
from kimi_helix.kernels.draft_attention import draft_attention, draft_attention_ref
from kimi_helix.kernels.draft_attention.triton import draft_attention_triton

from ..conftest import DEVICE, TOL, assert_rel_close
from .conftest import make_inputs, poison_unseen

pytestmark = pytest.mark.usefixtures("nan_empty")


def _assert_close_per_request(out, ref, tol):
    """Each request on its own: a wrong edge in one request must not hide in the others' norm."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    for n in range(out.shape[0]):
        assert_rel_close(f"out[{n}]", out[n], ref[n], tol)


@pytest.mark.parametrize("d", [32, 64], ids=["D32", "D64"])
@pytest.mark.parametrize("h", [1, 4], ids=["H1", "H4"])
@pytest.mark.parametrize("g", [1, 4, 7], ids=["G1", "G4", "G7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference(dtype, g, h, d):
    q, k_blk, v_blk, kv, slots, lengths = make_inputs(g, h, d, dtype, seed=g + 10 * h + d)
    ref = draft_attention_ref(q, k_blk, v_blk, *kv.unbind(2), slots, lengths)
    out = draft_attention_triton(q, k_blk, v_blk, *poison_unseen(kv, slots, lengths).unbind(2), slots, lengths)
    _assert_close_per_request(out, ref, TOL[dtype])


def test_lengths_outside_the_cache_are_clamped_as_the_reference_masks():
    """A length past C sees all C rows, a negative one none: as the reference's mask, without reading past C."""
    q, k_blk, v_blk, kv, slots, _ = make_inputs(4, 2, 32, torch.float32, seed=3)
    c = kv.shape[1]
    lengths = torch.tensor([-1, c + 5, 0, c, 3, c + 1, 1], device=DEVICE)
    ref = draft_attention_ref(q, k_blk, v_blk, *kv.unbind(2), slots, lengths)
    poisoned = poison_unseen(kv, slots, lengths.clamp(0, c))
    _assert_close_per_request(draft_attention_triton(q, k_blk, v_blk, *poisoned.unbind(2), slots, lengths), ref, 1e-5)


def test_switch_dispatches_and_gates_on_the_head_dim():
    """Both backends agree through the switch (int32 slots and lengths, a given scale); on CUDA a head dim the
    kernel cannot tile falls back to the reference, and forcing Triton says why."""
    q, k_blk, v_blk, kv, slots, lengths = make_inputs(7, 4, 64, torch.float32, seed=7)
    args = (q, k_blk, v_blk, *poison_unseen(kv, slots, lengths).unbind(2), slots.int(), lengths.int())
    out = draft_attention(*args, scale=0.3, backend="triton")
    ref = draft_attention(q, k_blk, v_blk, *kv.unbind(2), slots.int(), lengths.int(), scale=0.3, backend="torch")
    _assert_close_per_request(out, ref, TOL[torch.float32])
    assert select(OpRequest("draft_attention", "bf16", "cuda", 128)) == "triton"
    assert select(OpRequest("draft_attention", "bf16", "cuda", 48)) == "torch"
    with pytest.raises(BackendUnavailableError, match=r"head_dim=48 is not a power of two in \[16, 256\]"):
        select(OpRequest("draft_attention", "bf16", "cuda", 48), "triton")


def test_bad_arguments_raise_naming_the_argument():
    q, k_blk, v_blk, kv, slots, lengths = make_inputs(4, 2, 32, torch.float32, seed=9)
    k_ctx, v_ctx = kv.unbind(2)
    args = (q, k_blk, v_blk, k_ctx, v_ctx, slots, lengths)
    cases = {
        "q must be a fp32/fp16/bf16 tensor": {0: q.double()},
        r"q must be .* \[N, G, H, D\]": {0: q[0]},
        "k_blk must have shape": {1: k_blk[:, :2]},
        "v_blk must have shape": {2: v_blk[..., :16]},
        r"k_ctx must have shape \[S, C, H, D\] with H=2": {3: k_ctx[:, :, :1]},
        "v_ctx must have shape": {4: v_ctx[:, :3]},
        "v_ctx must have q's dtype": {4: v_ctx.half()},
        "k_ctx is on meta": {3: k_ctx.to("meta")},
        "slots must be an int32/int64 tensor": {5: slots.float()},
        r"lengths must be an int32/int64 tensor of shape \[7\]": {6: lengths[:3]},
    }
    for fn in (draft_attention_ref, draft_attention_triton):
        for match, change in cases.items():
            with pytest.raises(ValueError, match=match):
                fn(*(change.get(i, a) for i, a in enumerate(args)))
    q48, k48, v48, kv48, slots, lengths = make_inputs(1, 1, 48, torch.float32, seed=9)
    with pytest.raises(ValueError, match="head dim D=48 is not a power of two in"):
        draft_attention_triton(q48, k48, v48, *kv48.unbind(2), slots, lengths)
