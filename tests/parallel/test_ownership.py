"""The ownership rule and its closed forms against brute force over small page sizes, cp sizes and lengths."""

import pytest
import torch

from kimi_helix.modeling.config import KimiK3Config
from kimi_helix.parallel import Mapping, Ownership, ParallelConfigError
from kimi_helix.parallel.helix import HelixPageLedger


def brute_owner(p: int, ps: int, cp: int) -> int:
    return (p // ps) % cp


@pytest.mark.parametrize("ps,cp", [(1, 1), (1, 3), (2, 2), (3, 4), (4, 3), (5, 2)])
def test_local_len_matches_brute_force(ps, cp):
    lengths = torch.arange(0, 4 * ps * cp + 3)
    for r in range(cp):
        own = Ownership(ps, cp, r)
        brute = [sum(brute_owner(p, ps, cp) == r for p in range(n)) for n in lengths.tolist()]
        assert own.local_len(lengths).tolist() == brute
        assert [own.local_len(n) for n in lengths.tolist()] == brute
        assert [own.local_pages(n) for n in lengths.tolist()] == [-(-b // ps) for b in brute]
    # Every position is owned by exactly one rank, and the local lengths add up to the global one.
    total = sum(Ownership(ps, cp, r).local_len(lengths) for r in range(cp))
    assert torch.equal(total, lengths)


@pytest.mark.parametrize("ps,cp", [(2, 2), (3, 3), (4, 2)])
def test_ledger_slots_and_bounds_brute_force(ps, cp):
    """Through the Helix ledger and the engine's slot rule: each token is written once, on its owner, at local index
    = its rank among the owner's tokens; bounds count the owner's tokens <= p; pages are what the rank needs."""
    n = 5 * ps * cp + 1
    positions = torch.arange(n)
    stored: dict[int, tuple[int, int]] = {}
    for r in range(cp):
        own = Ownership(ps, cp, r)
        ledger = HelixPageLedger(64, ps, 1, own)
        pages = ledger.admit(0, n, map_now=True).pages  # global-indexed, -1 where another rank owns the page
        assert sum(p >= 0 for p in pages) == own.local_pages(n) == ledger.pages_in_use
        table = torch.tensor(pages)
        slot_mapping = table[positions // ps] * ps + positions % ps  # what the runner computes
        slots = own.write_slots(positions, slot_mapping)
        mine = [p for p in range(n) if brute_owner(p, ps, cp) == r]
        assert [p for p in range(n) if slots[p] >= 0] == mine
        local = own.local_block_table(table[None])[0]
        for k, p in enumerate(mine):  # the k-th owned token sits at local index k of the local block table
            assert slots[p].item() == local[k // ps].item() * ps + k % ps
            stored[p] = (r, slots[p].item())
        bounds = own.kv_bounds(positions)
        assert bounds.tolist() == [sum(q <= p for q in mine) for p in range(n)]
        ledger.release(0)
        assert ledger.pages_in_use == 0
    assert sorted(stored) == list(range(n))


def test_ledger_admits_identically_on_every_rank():
    """Admission is counted in rank 0's pages (the most of any rank), so all ranks take the same decisions."""
    ledgers = [HelixPageLedger(5, 4, 8, Ownership(4, 3, r)) for r in range(3)]
    decisions = []
    for seq, tokens in enumerate([13, 9, 30, 4, 1, 1]):  # rank-0 pages: 2, 1, (3), 1, 1, (1) of 5
        ok = [lg.can_admit(tokens) for lg in ledgers]
        assert len(set(ok)) == 1
        decisions.append(ok[0])
        if ok[0]:
            for lg in ledgers:
                lg.admit(seq, tokens)
    assert decisions == [True, True, False, True, True, False]


def test_straddling_verify_group():
    """page_size 4, cp 2, a group at positions 6..9 straddles pages 1 (rank 1) and 2 (rank 0)."""
    positions = torch.arange(6, 10)
    r0, r1 = Ownership(4, 2, 0), Ownership(4, 2, 1)
    assert r0.owner(positions).tolist() == [1, 1, 0, 0]
    assert r0.kv_bounds(positions).tolist() == [4, 4, 5, 6]  # page 0 cached, then its own 8, 9
    assert r1.kv_bounds(positions).tolist() == [3, 4, 4, 4]  # its 4, 5 cached, then 6, 7
    assert r0.write_slots(positions, torch.tensor([-2, -1, 12, 13])).tolist() == [-1, -1, 12, 13]


def test_mapping_grid_and_repurpose():
    m = Mapping(tp=2, cp=3, rank=4)
    assert (m.world_size, m.tp_rank, m.cp_rank) == (6, 1, 1)
    assert m.cp_group_ranks() == [3, 4, 5]
    assert m.all_cp_groups() == [[0, 1, 2], [3, 4, 5]]
    flat = m.repurpose_cp_to_tp()
    assert (flat.tp, flat.cp, flat.rank, flat.tp_rank) == (6, 1, 4, 4)


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("MLA heads", {"num_attention_heads": 6}),
        ("KDA heads", {"linear_attn_config": {"num_heads": 2, "full_attn_layers": [2]}}),
        ("num_experts", {"num_experts": 6, "num_experts_per_token": 2}),
    ],
)
def test_mapping_rejects_uneven_splits(field, kwargs):
    base = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        linear_attn_config={"num_heads": 4, "head_dim": 8, "full_attn_layers": [2]}, num_experts=4,
        num_experts_per_token=2,
    )  # fmt: skip
    base.update(kwargs)
    with pytest.raises(ParallelConfigError, match=field):
        Mapping(tp=2, cp=2, rank=0).validate(KimiK3Config(**base))


def test_mapping_rejects_bad_fields():
    with pytest.raises(ParallelConfigError, match="Mapping.cp"):
        Mapping(tp=1, cp=0)
    with pytest.raises(ParallelConfigError, match="Mapping.rank"):
        Mapping(tp=2, cp=2, rank=4)
    with pytest.raises(ParallelConfigError, match="page_size"):
        Mapping(tp=1, cp=2).validate(KimiK3Config(num_hidden_layers=2, num_experts=0), 16, 64)
