"""MLA: the torch references against independent oracles (dense softmax, transformers, loops)."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.mla import mla_prefill
from kimi_helix.kernels.mla.naive import mla_decode_ref, mla_prefill_ref

from ..conftest import assert_rel_close
from .conftest import PAIRS, assert_rel_close_inf, dense_decode_attention, make_case, make_inputs


def dense_prefill_attention(q, k, v, pairs, scale):
    """All sequences at once in fp64: one [Tq, Tk] mask that is block-diagonal over sequences and causal within."""
    q_seq = torch.cat([torch.full((tq,), i) for i, (tq, _) in enumerate(pairs)])
    q_pos = torch.cat([torch.arange(tk - tq, tk) for tq, tk in pairs])  # queries are the last Tq_i positions
    k_seq = torch.cat([torch.full((tk,), i) for i, (_, tk) in enumerate(pairs)])
    k_pos = torch.cat([torch.arange(tk) for _, tk in pairs])
    visible = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.double())
    return out, torch.logsumexp(scores, dim=-1).transpose(0, 1)


@pytest.mark.parametrize("s_q", [[1, 1, 1], [2, 3, 1], [4, 4, 4]])
def test_reference_matches_dense_softmax(s_q):
    args, dense = make_case([37, 5, 70], s_q, H=3, seed=len(s_q) + s_q[0])
    out, lse = mla_decode_ref(**args)
    want_out, want_lse = dense_decode_attention(args, dense)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_rel_close_inf("out", out, want_out, 1e-6)
    assert_rel_close_inf("lse", lse, want_lse, 1e-6)


@pytest.mark.parametrize("H", [1, 3])
def test_reference_matches_dense(H):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, H, 48, 16, torch.float32, seed=H, device="cpu")
    out, lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.3)
    d_out, d_lse = dense_prefill_attention(q, k, v, PAIRS, 0.3)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_rel_close("out", out, d_out, 1e-6)
    assert_rel_close("lse", lse, d_lse, 1e-6)


def test_reference_empty_rows():
    """A query that sees no key (more queries than keys: not a valid prefill) gets lse -inf and a zero output."""
    q, k, v, _, _ = make_inputs([(3, 2)], 2, 16, 16, torch.float32, device="cpu")
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    out, lse = mla_prefill_ref(q, k, v, cu_q, cu_k, 0.3)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all() and torch.isfinite(lse[1:]).all()


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_references_take_host_offsets(backend):
    q, k, v, cu_q, cu_k = make_inputs(PAIRS, 2, 32, 16, torch.float32, device="cpu")
    expected, _ = mla_prefill(q, k, v, cu_q, cu_k, 0.25, backend=backend)
    # device offsets that disagree are not read when the host's are given
    wrong = torch.zeros_like(cu_q)
    out, _ = mla_prefill(q, k, v, wrong, wrong, 0.25, host_offsets=(cu_q, cu_k.tolist()), backend=backend)
    torch.testing.assert_close(out, expected)
