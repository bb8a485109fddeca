"""The scheduler itself: phases and their order, the token budget rule, admission order, no starved request."""

import random

import pytest

from kimi_helix.engine.cache import PageLedger
from kimi_helix.engine.sampling import SamplingParams
from kimi_helix.engine.scheduler import Request, Scheduler
from kimi_helix.modeling.batch import Phase


def make_scheduler(budget=16, max_num_seqs=8, num_pages=64, page_size=16):
    return Scheduler(PageLedger(num_pages, page_size, max_num_seqs), max_num_seqs, budget, max_model_len=4096)


def request(i, prompt_len, max_tokens=8):
    return Request(i, None, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens), None)


def decoding(sched, i, prompt_len=4, outputs=1, drafts=(), max_tokens=8):
    """Put a request in the running set as if its prompt and `outputs - 1` sampled tokens were cached."""
    r = request(i, prompt_len, max_tokens)
    sched.ledger.admit(i, r.reserve_tokens)
    r.output_ids = [7] * outputs
    r.num_computed = prompt_len + outputs - 1
    r.draft_token_ids = list(drafts)
    sched.running.append(r)
    return r


def advance(step):
    """What LLM.step does to the scheduler's requests: tokens computed, one sampled where the prompt is done."""
    for r, n, phase in zip(step.requests, step.num_tokens, step.phases):
        r.num_computed += n
        if phase is Phase.VERIFY:  # accept every draft, plus the bonus token
            r.output_ids += r.draft_token_ids[: n - 1] + [7]
            r.draft_token_ids = []
        elif not r.prefilling:
            r.output_ids.append(7)


def test_decodes_and_verifies_come_before_prefill_chunks_with_declared_phases():
    sched = make_scheduler(budget=64)
    sched.add(request(0, 30))  # arrives first, still prefilling below
    sched.schedule()
    d = decoding(sched, 1)
    v = decoding(sched, 2, drafts=[9, 9, 9])
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == [1, 2, 0]
    assert step.phases == [Phase.DECODE, Phase.VERIFY, Phase.PREFILL]
    assert step.token_ids[0] == [d.token_ids[d.num_computed]]
    assert step.token_ids[1] == [v.token_ids[v.num_computed], 9, 9, 9]


def test_token_budget_split_one_each_then_drafts_then_prefill_in_arrival_order():
    sched = make_scheduler(budget=16)
    decoding(sched, 2)
    decoding(sched, 3, drafts=[5, 5, 5, 5])
    decoding(sched, 4)
    sched.add(request(0, 20))
    sched.add(request(1, 20))
    step = sched.schedule()
    # 5 running -> 5 tokens granted; 11 left: 4 drafts, then prefill 0 takes 1 + 7, prefill 1 keeps its 1.
    assert dict(zip([r.request_id for r in step.requests], step.num_tokens)) == {2: 1, 3: 5, 4: 1, 0: 8, 1: 1}
    assert step.total_tokens == 16


def test_drafts_are_cut_to_the_budget_and_to_what_max_tokens_can_use():
    sched = make_scheduler(budget=8)
    decoding(sched, 0, outputs=6, drafts=[5] * 6, max_tokens=8)  # 2 tokens left to generate: 1 draft + the bonus
    long = decoding(sched, 1, drafts=[5] * 6, max_tokens=50)
    step = sched.schedule()
    assert step.num_tokens == [2, 6]  # 2 granted, 6 left: 1 for the short request, 5 (not 6) for the long one
    assert step.phases == [Phase.VERIFY, Phase.VERIFY]
    assert long.draft_token_ids == [5] * 6  # the proposer's drafts are left alone


def test_a_long_prompt_never_takes_the_budget_from_running_decodes():
    sched = make_scheduler(budget=32, num_pages=128)
    for i in range(3):
        decoding(sched, i)
    sched.add(request(3, 1000, max_tokens=2))
    step = sched.schedule()
    counts = dict(zip([r.request_id for r in step.requests], step.num_tokens))
    assert counts == {0: 1, 1: 1, 2: 1, 3: 29}


def test_admission_follows_arrival_order_and_a_blocked_head_blocks_the_rest():
    sched = make_scheduler(budget=64, num_pages=6, page_size=16)
    sched.add(request(0, 40))  # 3 pages
    sched.add(request(1, 60))  # 5 pages: does not fit beside request 0
    sched.add(request(2, 20))  # 2 pages would fit beside request 0, but it must wait behind request 1
    sched.schedule()
    assert [r.request_id for r in sched.running] == [0]
    assert [r.request_id for r in sched.waiting] == [1, 2]
    sched.finish(sched.running[0], "length")
    sched.schedule()
    assert [r.request_id for r in sched.running] == [1]
    assert [r.request_id for r in sched.waiting] == [2]


def test_admission_counts_running_reservations_not_free_pages():
    """Admission maps no page, yet a request waits while the running ones' reservations leave it too few pages."""
    sched = make_scheduler(budget=64, num_pages=6, page_size=16)
    sched.add(request(0, 40))  # reserves 3 pages
    sched.add(request(1, 50))  # 4 pages: all 6 are free, but only 3 unreserved
    sched.schedule()
    assert [r.request_id for r in sched.running] == [0] and [r.request_id for r in sched.waiting] == [1]
    assert sched.ledger.pages_in_use == 0 and sched.ledger.reserved_pages == 3
    sched.finish(sched.running[0], "length")
    sched.schedule()
    assert [r.request_id for r in sched.running] == [1] and sched.ledger.reserved_pages == 4


def test_running_never_exceeds_the_token_budget_so_everyone_gets_a_token():
    sched = make_scheduler(budget=3, max_num_seqs=8)
    for i in range(6):
        sched.add(request(i, 2))
    step = sched.schedule()
    assert len(sched.running) == 3 and [r.request_id for r in step.requests] == [0, 1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_no_running_request_ever_gets_zero_tokens(seed):
    rng = random.Random(seed)
    budget = rng.choice([4, 7, 16])
    sched = make_scheduler(budget=budget, max_num_seqs=6, num_pages=40, page_size=8)
    for i in range(12):
        sched.add(request(i, rng.randint(1, 40), max_tokens=rng.randint(1, 6)))
    steps = 0
    while sched.has_work:
        for r in sched.running:
            if not r.prefilling and rng.random() < 0.5:
                r.draft_token_ids = [5] * rng.randint(1, 4)
        step = sched.schedule()
        assert sorted(r.request_id for r in step.requests) == sorted(r.request_id for r in sched.running)
        assert all(n >= 1 for n in step.num_tokens) and step.total_tokens <= budget
        kinds = [p is Phase.PREFILL for p in step.phases]
        assert kinds == sorted(kinds)  # decodes and verifies first
        advance(step)
        for r in list(sched.running):
            if len(r.output_ids) >= r.params.max_tokens:
                sched.finish(r, "length")
        steps += 1
        assert steps < 500
