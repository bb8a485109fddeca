"""Pages are reserved at admission (a count), mapped as the cached length needs them and returned at a rollback:
the ledger's accounting on its own, then an engine run whose verify groups (drafts with a wrong token at a cycling
position, so every acceptance length occurs) straddle 4-token pages, in one process and on two Helix cp ranks."""

import copy
import random

import pytest
import torch

from kimi_helix.engine import LLM, PageLedger, SamplingParams
from kimi_helix.modeling import KimiK3ForCausalLM
from kimi_helix.parallel.distributed import init_distributed
from kimi_helix.parallel.helix import NOT_HERE, HelixPageLedger
from kimi_helix.parallel.ownership import Ownership

from ..parallel.harness import check_all_ok, parallel_test_config, spawn
from .test_llm import make_model, prompts

PAGE = 4
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


def cdiv(a, b):
    return -(-a // b)


def test_admission_counts_reservations_not_free_pages():
    ledger = PageLedger(num_pages=10, page_size=PAGE, num_slots=4)
    ledger.admit(0, 24)  # reserves 6 pages, maps none
    assert ledger.pages_in_use == 0 and len(ledger.free_pages) == 10 and ledger.reserved_pages == 6
    assert ledger.can_admit(16) and not ledger.can_admit(17)  # 10 pages are free but only 4 unreserved
    with pytest.raises(RuntimeError, match="cannot admit sequence 1"):
        ledger.admit(1, 20)
    ledger.admit(1, 16)
    assert not ledger.can_admit(1)
    ledger.release(0)
    assert ledger.can_admit(24) and ledger.reserved_pages == 4


def test_pages_are_mapped_lazily_freed_at_truncate_and_reused():
    ledger = PageLedger(num_pages=8, page_size=PAGE, num_slots=2)
    blocks = ledger.admit(0, 14)
    assert blocks.pages == [] and blocks.table_row().tolist() == []
    assert ledger.map(0, 1) is blocks and len(blocks.pages) == 1
    ledger.map(0, 4)
    assert len(blocks.pages) == 1 and ledger.pages_in_use == 1  # still inside the first page
    ledger.map(0, 10)
    assert len(blocks.pages) == 3 and ledger.pages_in_use == 3
    assert blocks.table_row().tolist() == blocks.pages
    with pytest.raises(ValueError, match="tokens=15 for sequence 0 exceeds the 14 tokens it reserved"):
        ledger.map(0, 15)
    blocks.length = 10
    with pytest.raises(ValueError, match="num_keep must be in"):
        ledger.truncate(0, 11)
    ledger.truncate(0, 5)  # pages 0 and 1 still hold tokens 0..4
    assert len(blocks.pages) == 2 and blocks.length == 5 and ledger.pages_in_use == 2
    freed = ledger.free_pages[-1]
    ledger.truncate(0, 4)
    second = ledger.free_pages[-1]
    assert len(blocks.pages) == 1 and ledger.pages_in_use == 1 and {freed, second} <= set(ledger.free_pages)
    ledger.map(0, 9)  # the freed pages come back, in their order
    assert blocks.pages[1:] == [second, freed] and blocks.table_row().tolist() == blocks.pages
    assert ledger.reserved_pages == 4  # truncation kept the reservation
    ledger.release(0)
    assert ledger.pages_in_use == 0 and ledger.reserved_pages == 0 and len(ledger.free_slots) == 2


def test_random_ledger_operations_keep_every_reservation_mappable():
    """Random admissions, growth, truncations and releases: mapped pages are distinct, free + mapped = all, and at
    every point each running sequence can still map up to its reservation (a running sequence never waits)."""
    rng = random.Random(0)
    ledger = PageLedger(num_pages=12, page_size=PAGE, num_slots=4)
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 and ledger.can_admit(n := rng.randint(1, 30)):
            ledger.admit(next_id, n)
            next_id += 1
        elif op < 0.7 and ledger.seqs:
            s = rng.choice(list(ledger.seqs))
            b = ledger.seqs[s]
            b.length = rng.randint(b.length, b.reserve_tokens)
            ledger.map(s, b.length)
        elif op < 0.9 and ledger.seqs:
            s = rng.choice(list(ledger.seqs))
            ledger.truncate(s, rng.randint(0, ledger.seqs[s].length))
        elif ledger.seqs:
            ledger.release(rng.choice(list(ledger.seqs)))
        mapped = [p for b in ledger.seqs.values() for p in b.pages]
        assert len(set(mapped)) == len(mapped) and len(mapped) + len(ledger.free_pages) == ledger.num_pages
        assert ledger.reserved_pages == sum(cdiv(b.reserve_tokens, PAGE) for b in ledger.seqs.values())
        unmapped = sum(cdiv(b.reserve_tokens, PAGE) - len(b.pages) for b in ledger.seqs.values())
        assert len(ledger.free_pages) >= unmapped
    assert next_id > 10


@pytest.mark.parametrize("cp", [2, 3])
def test_helix_ledger_maps_and_frees_only_its_own_pages(cp):
    ledgers = [HelixPageLedger(6, PAGE, 2, Ownership(PAGE, cp, r)) for r in range(cp)]
    for lg in ledgers:
        lg.admit(0, 40)
    for length, keep in [(9, 9), (23, 13), (30, 4), (40, 40)]:
        for lg in ledgers:
            pages = lg.map(0, length).pages
            assert len(pages) == cdiv(length, PAGE) and lg.seqs[0].table_row().tolist() == pages
            assert [b for b, p in enumerate(pages) if p != NOT_HERE] == lg.ownership.owned_pages(len(pages))
            lg.seqs[0].length = length
            lg.truncate(0, keep)
            assert lg.pages_in_use == lg.ownership.local_pages(keep) == sum(p != NOT_HERE for p in lg.seqs[0].pages)
    assert all(lg.reserved_pages == ledgers[0].ownership.local_pages(40) for lg in ledgers)


def _forced_drafts(llm, reference, k, vocab, step):
    """Give every decoding request k drafts for the next step: its reference greedy continuation with the token at a
    position that cycles with the step made wrong (k: all right)."""
    for r in llm.scheduler.running:
        if not r.prefilling:
            done = len(r.output_ids)
            bad = (step + r.request_id) % (k + 1)
            drafts = reference[r.request_id][done : done + k]
            r.draft_token_ids = [(t + 1) % vocab if j == bad else t for j, t in enumerate(drafts)]


def _run_with_rollbacks(llm, prompts_, reference, k):
    """Run to the end with forced drafts. Returns (outputs, per step {request: (length, pages)} with the step's
    reported pages_in_use, and per rollback (pages before, kept tokens, pages after, free pages after))."""
    ledger, rollbacks, trace = llm.cache.ledger, [], []
    rollback_many = llm.cache.rollback_many

    def spied(cuts):
        before = [list(ledger.seqs[seq_id].pages) for seq_id, _ in cuts]
        rollback_many(cuts)
        for pages, (seq_id, num_keep) in zip(before, cuts):
            rollbacks.append((pages, num_keep, list(ledger.seqs[seq_id].pages), set(ledger.free_pages)))

    llm.cache.rollback_many = spied
    requests = [llm._make_request(p, GREEDY) for p in prompts_]
    for r in requests:
        llm.scheduler.add(r)
    while llm.scheduler.has_work:
        _forced_drafts(llm, reference, k, llm.model.config.vocab_size, len(trace))
        llm.step()
        seqs = {r.request_id: ledger.seqs[r.request_id] for r in llm.scheduler.running}
        trace.append(({i: (b.length, list(b.pages)) for i, b in seqs.items()}, llm.metrics[-1].pages_in_use))
    assert not ledger.seqs and len(ledger.free_pages) == ledger.num_pages and ledger.reserved_pages == 0
    return [r.output_ids for r in requests], trace, rollbacks


def _check_rollbacks(rollbacks):
    """Each rollback kept exactly the pages covering the kept tokens and returned the rest to the free list; some
    returned a page and some returned page was mapped again later. Returns how many returned a page."""
    freeing = 0
    for before, keep, after, free in rollbacks:
        assert after == before[: cdiv(keep, PAGE)]
        dropped = [p for p in before[len(after) :] if p != NOT_HERE]
        assert set(dropped) <= free
        freeing += bool(dropped)
    reused = any(
        (set(before[len(after) :]) - {NOT_HERE}) & set(later[0])
        for i, (before, _, after, _) in enumerate(rollbacks)
        for later in rollbacks[i + 1 :]
    )
    return freeing, reused


@pytest.mark.parametrize("k", [3, 5])
def test_rollback_releases_pages_and_greedy_output_is_unchanged(k):
    model = make_model()
    ps = prompts([5, 11, 3, 8], seed=21)
    plain = [o.token_ids for o in LLM(model, page_size=PAGE).generate(ps, GREEDY)]
    got, trace, rollbacks = _run_with_rollbacks(LLM(model, page_size=PAGE), ps, plain, k)
    assert got == plain
    for seqs, in_use in trace:  # after every step, rollbacks included: exactly the pages the length needs
        assert all(len(pages) == cdiv(length, PAGE) for length, pages in seqs.values())
        assert in_use == sum(len(pages) for _, pages in seqs.values())
    freeing, reused = _check_rollbacks(rollbacks)
    assert len(rollbacks) > 5 and freeing > 0 and reused


def _helix_rank(rank, world, k):
    ctx = init_distributed(timeout_s=60)
    try:
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(parallel_test_config()).eval()
        kw = dict(page_size=PAGE, max_num_seqs=4, max_model_len=48, device="cpu")
        ps = [[5, 9, 2, 5, 9], [7, 1, 3, 8, 7, 1, 3, 8, 7], list(range(10, 21))]
        plain = [o.token_ids for o in LLM(copy.deepcopy(model), **kw).generate(ps, GREEDY, use_tqdm=False)]
        llm = LLM(copy.deepcopy(model), context_parallel_size=2, **kw)
        got, trace, rollbacks = _run_with_rollbacks(llm, ps, plain, k)
        own = llm.cache.ledger.ownership
        for seqs, in_use in trace:  # global-indexed page lists; this rank maps only the pages it owns
            assert all(len(pages) == cdiv(length, PAGE) for length, pages in seqs.values())
            assert all(sum(p != NOT_HERE for p in pages) == own.local_pages(length) for length, pages in seqs.values())
            assert in_use == sum(own.local_pages(length) for length, _ in seqs.values())
        freeing, reused = _check_rollbacks(rollbacks)
        return {"plain": plain, "got": got, "rollbacks": len(rollbacks), "freeing": freeing, "reused": reused}
    finally:
        ctx.close()


def test_helix_cp2_rollback_releases_each_ranks_pages():
    for r in check_all_ok(spawn(_helix_rank, 2, 3), 2):  # every rank holds the requests' outputs
        assert r["got"] == r["plain"] and r["rollbacks"] > 3 and r["freeing"] > 0 and r["reused"]
