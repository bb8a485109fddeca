"""Asynchronous scheduling: the same tokens as synchronous steps, every stop rule late by one step only in time,
each step launched before the previous one is read, and the cache left clean."""

import pytest
import torch

from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.engine.async_scheduling import PLACEHOLDER, AsyncScheduling

from .test_llm import make_model, prompts


def engines(model, **kwargs):
    return LLM(model, async_scheduling=False, **kwargs), LLM(model, async_scheduling=True, **kwargs)


def token_ids(outputs):
    return [(o.token_ids, o.finish_reason) for o in outputs]


def assert_clean(llm):
    """Every page free, every state slot zero and no step in flight after a generate call, except the CUDA
    graphs' scratch sequence (one page and one slot, which the padding rows of replays write)."""
    graphs = llm.runner.graphs
    scratch = [] if graphs is None else [graphs.scratch_slot]
    assert llm.scheduler.ledger.pages_in_use == len(scratch) and not llm.scheduler.running
    assert llm.async_scheduling.in_flight is None
    for pool in (*llm.cache.recurrent.values(), *llm.cache.conv.values()):
        kept = [s for s in range(pool.shape[0]) if s not in scratch]
        assert not pool[kept].any()


def spy(monkeypatch):
    """Record, per overlapped step, whether a step was in flight when it launched and the (input row, sampled row)
    pairs it patched on the device. Install before building the engines (they bind the patch method)."""
    launches, patches = [], []
    launch, patch = AsyncScheduling._launch, AsyncScheduling._patch_inputs

    def spying_launch(self, step, previous):
        launches.append(previous is not None)
        return launch(self, step, previous)

    def spying_patch(self, step, input_ids):
        starts = torch.tensor([0, *step.num_tokens]).cumsum(0).tolist()
        pairs = [(starts[i], self._inputs_of.source[r.request_id])
                 for i, (r, ids) in enumerate(zip(step.requests, step.token_ids)) if ids[0] == PLACEHOLDER]  # fmt: skip
        patches.append(pairs)
        return patch(self, step, input_ids)

    monkeypatch.setattr(AsyncScheduling, "_launch", spying_launch)
    monkeypatch.setattr(AsyncScheduling, "_patch_inputs", spying_patch)
    return launches, patches


def test_greedy_mixed_steps_equal_synchronous_steps_and_overlap(monkeypatch):
    """Prompts of mixed lengths, chunked prefill beside decodes, max_tokens per request and admissions while
    others decode: token for token the synchronous result, with steps launched over steps in flight."""
    model = make_model()
    ps = prompts([5, 70, 1, 33, 129, 9], seed=11)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 3, 9, 1, 7, 12)]
    launches, patches = spy(monkeypatch)
    sync, overlapped = engines(model, page_size=16, max_num_batched_tokens=40, max_num_seqs=3)
    expected = token_ids(sync.generate(ps, params))
    assert token_ids(overlapped.generate(ps, params)) == expected
    assert [len(t) for t, _ in expected] == [12, 3, 9, 1, 7, 12]
    assert sum(launches) >= 10  # most steps launched while the one before was still on the device
    runs = [pairs == [(d, pairs[0][1] + d - pairs[0][0]) for d, _ in pairs] for pairs in patches if pairs]
    assert any(runs) and not all(runs)  # both the one-run copy and the gathered copy were needed
    assert_clean(overlapped)


def test_stops_found_one_step_late_drop_the_extra_token():
    """EOS, stop tokens and a stop token on the very first sampled token: the request was already scheduled
    again when its stop was read; that token is dropped and the output equals the synchronous one."""
    model = make_model()
    ps = prompts([10, 4, 27], seed=4)
    free = LLM(model, async_scheduling=False).generate(ps, SamplingParams(max_tokens=12, temperature=0))
    stops = [free[0].token_ids[3], free[1].token_ids[0], free[2].token_ids[6]]
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[s]) for s in stops]
    sync, overlapped = engines(model)
    expected = token_ids(sync.generate(ps, params))
    assert [reason for _, reason in expected] == ["stop"] * 3
    assert token_ids(overlapped.generate(ps, params)) == expected
    assert_clean(overlapped)


def test_seeded_sampling_draws_the_same_tokens():
    model = make_model()
    ps = prompts([9, 21, 3], seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    sync, overlapped = engines(model, max_num_batched_tokens=16)
    assert token_ids(overlapped.generate(ps, params)) == token_ids(sync.generate(ps, params))


def test_logprobs_requests_run_synchronously_beside_overlapped_ones(monkeypatch):
    """A request asking for logprobs makes the steps it shares synchronous (its logits are read between steps);
    the engine drains the step in flight first, and the tokens and logprobs are the synchronous ones."""
    model = make_model()
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    launches, _ = spy(monkeypatch)
    sync, overlapped = engines(model)
    first = overlapped.generate(prompts([6, 13], seed=5), greedy)
    assert launches  # overlapped without logprobs
    launches.clear()
    ps = prompts([7, 12], seed=6)
    params = [greedy, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)]
    got, want = overlapped.generate(ps, params), sync.generate(ps, params)
    assert not launches
    assert token_ids(got) == token_ids(want)
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        if w.logprobs is not None:
            assert [sorted(d) for d in g.logprobs] == [sorted(d) for d in w.logprobs]
            for gd, wd in zip(g.logprobs, w.logprobs):
                assert all(gd[t].logprob == pytest.approx(wd[t].logprob, abs=1e-6) for t in wd)
    assert token_ids(first) == token_ids(sync.generate(prompts([6, 13], seed=5), greedy))
    assert_clean(overlapped)


def test_a_failed_generate_with_a_step_in_flight_frees_everything(monkeypatch):
    model = make_model()
    llm = LLM(model, async_scheduling=True)
    calls = {"n": 0}
    complete = AsyncScheduling._complete

    def failing(self, done):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return complete(self, done)

    monkeypatch.setattr(AsyncScheduling, "_complete", failing)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts([8, 5], seed=8), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert llm.async_scheduling.in_flight is None
    assert llm.scheduler.ledger.pages_in_use == 0 and not llm.scheduler.running
    monkeypatch.setattr(AsyncScheduling, "_complete", complete)
    out = llm.generate(prompts([8], seed=8), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert out[0].num_generated_tokens == 4 and PLACEHOLDER not in out[0].token_ids


def test_placeholders_never_reach_the_outputs_or_the_requests():
    model = make_model()
    llm = LLM(model, async_scheduling=True, max_num_batched_tokens=24)
    outs = llm.generate(prompts([3, 30, 17, 8], seed=12), SamplingParams(max_tokens=6, temperature=0))
    assert all(PLACEHOLDER not in o.token_ids for o in outs)
    assert torch.tensor([t for o in outs for t in o.token_ids]).min() >= 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(async_scheduling="yes"), "async_scheduling must be None, True or False"),
        (dict(async_scheduling=True, tensor_parallel_size=2), "async_scheduling=True needs tensor_parallel_size"),
    ],
)  # fmt: skip
def test_async_scheduling_argument_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(make_model(), **kwargs)


def test_default_is_off_on_the_cpu_and_speculative_decoding_overlaps_rounds_instead():
    model = make_model()
    assert LLM(model).async_scheduling is None
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    spec = LLM(model, speculative_config=ngram, async_scheduling=None)
    assert spec.async_scheduling is None and spec.async_rounds is None
    spec = LLM(model, speculative_config=ngram, async_scheduling=True)
    assert spec.async_scheduling is None and spec.async_rounds is not None
    # ngram rounds cannot be derived on the device: they run synchronously, with plain greedy's tokens
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batch = prompts([3, 9], seed=5)
    want = [o.token_ids for o in LLM(model).generate(batch, params)]
    assert [o.token_ids for o in spec.generate(batch, params)] == want
    assert spec.async_rounds.entered == 0


@pytest.mark.gpu
def test_graphed_overlapped_steps_give_the_eager_synchronous_tokens_without_syncing():
    """On the GPU (fp32): the default engine (CUDA graphs, asynchronous scheduling) gives the tokens of eager
    synchronous steps, stops included; a steady decode step issues no synchronising CUDA call (the wait for the
    previous step's tokens is an event's)."""
    from .test_cuda_graph import _model, _prompts

    model = _model("cuda")
    ps = _prompts(5)
    eager = LLM(model, enforce_eager=True, async_scheduling=False, page_size=16)
    free = eager.generate(ps, SamplingParams(max_tokens=12, temperature=0))
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[o.token_ids[4]]) for o in free]
    llm = LLM(model, page_size=16)
    assert llm.async_scheduling is not None and llm.runner.graphs is not None
    assert token_ids(llm.generate(ps, params)) == token_ids(eager.generate(ps, params))
    assert_clean(llm)

    for p in ps[:3]:  # requests registered and run by hand: steady decode steps under the sync checker
        llm.scheduler.add(llm._make_request(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    for _ in range(6):  # prefill, then graph captures
        llm.step()
    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            llm.step()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    while llm.scheduler.has_work:
        llm.step()
    llm.async_scheduling.drain()
