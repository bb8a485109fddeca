"""Greedy acceptance and next-step staging: the Triton kernel against `accept_and_stage_ref` (every written integer
exactly), and the reference against a per-group loop of plain Python written from the op's definition."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.accept_stage import accept_and_stage, accept_and_stage_ref
from kimi_helix.kernels.accept_stage.triton import accept_and_stage_triton

from ..conftest import DEVICE

POISON = -7  # every output starts as this, so a value the kernel never writes cannot pass


def _case(n: int, g: int, page: int, seed: int) -> dict:
    """n verify groups of g tokens whose kept drafts cycle through 0..g-1 (the anchor alone to the whole group),
    anchors at positions that cross page edges, a block table of shuffled page ids padded past the mapped pages."""
    gen = torch.Generator().manual_seed(seed)
    argmax = torch.randint(3, 50, (n, g), generator=gen)
    ids = torch.randint(3, 50, (n, g), generator=gen)
    for i in range(n):
        keep = (i + seed) % g
        ids[i, 1 : 1 + keep] = argmax[i, :keep]
        if keep < g - 1:
            ids[i, 1 + keep] = argmax[i, keep] + 1  # the first miss
    anchor_pos = torch.tensor([page - 2 + 7 * i for i in range(n)])
    width = (int(anchor_pos.max()) + 2 * g) // page + 2
    table = torch.randperm(4 * n * width, generator=gen)[: n * width].view(n, width).to(torch.int32)
    inputs = torch.stack([ids[:, 0], anchor_pos, torch.randperm(n, generator=gen) + 10])
    full = lambda *shape, dtype=torch.int64: torch.full(shape, POISON, dtype=dtype)  # noqa: E731
    tensors = dict(argmax=argmax, draft_inputs=inputs, input_ids=ids.reshape(-1), positions=full(n * g),
                   slot_mapping=full(n * g), cache_seqlens=full(n, dtype=torch.int32), block_table=table,
                   result=full(n, g + 1), write_at=full(2, n * g))  # fmt: skip
    return {name: t.to(DEVICE) for name, t in tensors.items()}


def _run(fn, case: dict, page: int) -> dict:
    out = {name: t.clone() for name, t in case.items()}
    fn(*out.values(), page)
    return out


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("n,g", [(1, 2), (3, 6), (5, 8), (2, 9)], ids=lambda v: str(v))
def test_triton_matches_reference(n, g, page):
    case = _case(n, g, page, seed=n * 10 + g)
    want, got = _run(accept_and_stage_ref, case, page), _run(accept_and_stage_triton, case, page)
    for name in case:
        assert torch.equal(got[name], want[name]), name
    assert (want["result"] != POISON).all() and (want["slot_mapping"] != POISON).all()


@pytest.mark.parametrize("n,g,page", [(4, 6, 4), (3, 8, 16)])
def test_reference_follows_the_definition(n, g, page):
    """Group i keeps a_i drafts (those before the first draft unequal to the argmax before it); its next anchor is
    argmax[i, a_i] at p_i + a_i + 1; the next step's slots come from the block table; the context rows written are
    the verified tokens' (slot, position)."""
    case = _case(n, g, page, seed=3)
    out = _run(accept_and_stage, case, page)
    argmax, ids = case["argmax"].tolist(), case["input_ids"].view(n, g).tolist()
    inputs, table = case["draft_inputs"].tolist(), case["block_table"].tolist()
    for i in range(n):
        a = 0
        while a < g - 1 and ids[i][1 + a] == argmax[i][a]:
            a += 1
        assert a == (i + 3) % g  # the case's construction
        p, slot, new = inputs[1][i], inputs[2][i], inputs[1][i] + a + 1
        assert out["result"][i].tolist() == argmax[i] + [a]
        assert out["draft_inputs"][:, i].tolist() == [argmax[i][a], new, slot]
        assert out["write_at"][:, i * g : (i + 1) * g].tolist() == [[slot] * g, list(range(p, p + g))]
        assert out["input_ids"][i * g : (i + 1) * g].tolist() == [argmax[i][a]] + ids[i][1:]
        want_pos = list(range(new, new + g))
        assert out["positions"][i * g : (i + 1) * g].tolist() == want_pos
        assert out["slot_mapping"][i * g : (i + 1) * g].tolist() == [table[i][q // page] * page + q % page
                                                                      for q in want_pos]  # fmt: skip
        assert out["cache_seqlens"][i].item() == new + g


def test_positions_past_the_table_read_its_last_page_in_both():
    """A staged step past the mapped pages (one the host never runs) reads the table's last entry, not memory past
    it, in the kernel and the reference alike."""
    case = _case(2, 6, 4, seed=1)
    case["block_table"] = case["block_table"][:, :1].contiguous()
    want, got = _run(accept_and_stage_ref, case, 4), _run(accept_and_stage_triton, case, 4)
    assert torch.equal(got["slot_mapping"], want["slot_mapping"])
    pages = want["slot_mapping"].view(2, 6).div(4, rounding_mode="floor")
    assert torch.equal(pages, case["block_table"].long().expand(2, 6))


def test_bad_arguments_name_the_field():
    case = _case(2, 4, 4, seed=0)
    case["cache_seqlens"] = case["cache_seqlens"].long()
    with pytest.raises(ValueError, match=r"cache_seqlens must be torch.int32 \[2\]"):
        accept_and_stage_ref(*case.values(), 4)
    case = _case(2, 4, 4, seed=0)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        accept_and_stage_triton(*case.values(), 0)
