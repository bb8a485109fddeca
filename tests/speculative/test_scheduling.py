"""Confidence scheduling: Algorithm 1's early stop is lossless where a global argmax is not (the DSpark paper's
counterexample), the step-rate table is profiled through the step callable and cached, and Helix prices draft
tokens by cp while the per-request intercept stays unscaled."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.engine.sampling import SamplingParams
from kimi_helix.engine.scheduler import Request
from kimi_helix.parallel.mapping import Mapping
from kimi_helix.speculative.engine import SpeculativeDecoder, build_speculative_decoder
from kimi_helix.speculative.proposers import Proposal, Proposer
from kimi_helix.speculative.scheduling import (
    StepRateTable,
    admit_top,
    cached_step_rate,
    confidence_schedule,
    fixed_schedule,
    plan_budget,
    profile_step_rate,
)
from kimi_helix.speculative.validator import SpeculativeConfig
from kimi_helix.speculative.verification import verify

from .test_verification import chi_square_p_value

# One token costs a full step, two cost double, but three fit a faster kernel tier (a jagged, realistic table).
JAGGED = StepRateTable([1, 2, 3], [1.0, 0.5, 0.6])


def _argmax_schedule(confidences, rate):
    """The unconstrained search: the best budget over the current confidences, then the top drafts."""
    return admit_top(confidences, plan_budget(confidences, rate))


def _first_token_counts(schedule, n: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Appendix A: target p1 = (0.7, 0.3); the drafter draws x1 uniformly; c1 = 0.5 and c2 = 1 if x1 = 0 else 0.
    Returns counts of the first emitted token and the verify lengths chosen."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.tensor([0.5, 0.5])
    logits = torch.tensor([0.7, 0.3]).log().expand(3, 2)
    counts, lengths = torch.zeros(2), []
    params = SamplingParams(temperature=1.0)
    for _ in range(n):
        drafts = [int(torch.multinomial(q, 1, generator=gen)) for _ in range(2)]
        conf = [[0.5, 1.0 if drafts[0] == 0 else 0.0]]
        (ell,) = schedule(conf, JAGGED)
        res = verify(drafts[:ell], q.expand(ell, 2), logits[: ell + 1], params, gen)
        counts[res.tokens[0]] += 1
        lengths.append(ell)
    return counts, lengths


def test_unconstrained_argmax_biases_the_output_and_the_early_stop_does_not():
    p = torch.tensor([0.7, 0.3])
    biased, biased_lengths = _first_token_counts(_argmax_schedule, 5000, seed=0)
    assert set(biased_lengths) == {0, 2}  # the draft x1 decides whether it is verified
    assert abs(biased[0] / biased.sum() - 0.85) < 0.015  # (0.7, 0.3) -> (0.85, 0.15)
    assert chi_square_p_value(biased, p) < 1e-6
    kept, lengths = _first_token_counts(confidence_schedule, 5000, seed=0)
    assert set(lengths) == {0}  # the first candidate does not pay, so the scan stops before seeing c2
    assert chi_square_p_value(kept, p) > 1e-3


def test_algorithm_1_admits_prefixes_while_throughput_improves():
    flat = StepRateTable([1, 64], [100.0, 90.0])  # nearly free tokens: admit every draft worth anything
    assert confidence_schedule([[0.9, 0.8, 0.5], [0.3, 0.9]], flat) == [3, 2]
    steep = StepRateTable([2, 3, 4, 8], [10.0, 7.0, 6.0, 3.0])
    # R=2: base 2 * 10 = 20. +0.9: 2.9 * 7 = 20.3 (admit); +0.72: 3.62 * 6 = 21.7 (admit); +0.5: 4.12 * 5.25 < 21.7.
    assert confidence_schedule([[0.9, 0.8], [0.5]], steep) == [2, 0]
    assert confidence_schedule([], steep) == []
    assert confidence_schedule([[1.0, 1.0, 0.0]], flat) == [2]  # ties keep positions in order; zero never pays


def test_helix_prices_draft_tokens_by_cp_and_not_the_intercept():
    rate = StepRateTable([4, 6, 8, 12], [10.0, 8.0, 7.0, 5.0])
    conf = [[0.9, 0.9], [0.8], [0.5], [0.5]]
    # cp=1: R=4 -> 40; +0.9 at B=5: 4.9 * 9 = 44.1; +0.81 at B=6: 5.71 * 8 = 45.7; +0.8 at B=7: 6.51 * 7.5 = 48.8;
    # +0.5 at B=8: 7.01 * 7 = 49.1; +0.5 at B=9: 7.51 * 6.5 < 49.1.
    assert confidence_schedule(conf, rate) == [2, 1, 1, 0]
    # cp=2: each draft costs 2 batch tokens, the four anchors still 4. +0.9 at B=6: 4.9 * 8 = 39.2 < 40: none.
    assert confidence_schedule(conf, rate, token_weight=2) == [0, 0, 0, 0]
    # With cheap enough tokens the intercept is what decides: 4 anchors are priced at B=4, not 4 * cp.
    cheap = StepRateTable([4, 6], [10.0, 9.9])
    assert confidence_schedule([[0.5]] * 4, cheap, token_weight=2) == [1, 0, 0, 0]


class _Confident(Proposer):
    """Proposes drafts with fixed per-request confidences."""

    def __init__(self, confidences):
        self.confidences = confidences

    def propose(self, requests):
        return [Proposal(list(range(1, len(c) + 1)), confidence=c) for c in self.confidences]


def _decoding(i):
    r = Request(i, None, [7, 8, 9], SamplingParams(max_tokens=8), None, output_ids=[3])
    r.num_computed = 3  # the prompt is cached; its first output token is the anchor
    return r


def test_decoder_prices_drafts_by_cp_under_helix(target):
    """The engine's decoder passes cp as the draft-token price (the four anchors stay 4 batch tokens); the test
    above shows what that price does to Algorithm 1."""
    conf = [[0.9, 0.9], [0.8], [0.5], [0.5]]
    rate = StepRateTable([4, 6, 8, 12], [10.0, 8.0, 7.0, 5.0])
    for cp, want in ((1, [2, 1, 1, 0]), (2, [0, 0, 0, 0])):
        requests = [_decoding(i) for i in range(4)]
        SpeculativeDecoder(target, _Confident(conf), 2, rate, token_weight=cp).propose(requests)
        assert [len(r.draft_token_ids) for r in requests] == want
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    for comm, weight in ((None, 1), (type("Comm", (), {"mapping": Mapping(tp=2, cp=3)})(), 3)):
        llm = type("LLM", (), {"model": target, "comm": comm, "runner": type("Runner", (), {})()})()
        assert build_speculative_decoder(spec, llm, None).token_weight == weight


def test_plan_budget_and_admit_top():
    rate = StepRateTable([2, 3, 4], [10.0, 9.0, 8.0])
    conf = [[0.9, 0.1], [0.6]]
    assert plan_budget(conf, rate) == 2 and admit_top(conf, 2) == [1, 1]
    assert admit_top(conf, 3) == [2, 1] and fixed_schedule([3, 0, 5], 4) == [3, 0, 4]


def test_step_rate_table_interpolates_and_extrapolates():
    t = StepRateTable([2, 4], [10.0, 6.0])
    assert t(1) == 10.0 and t(3) == pytest.approx(8.0) and t(8) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="increase"):
        StepRateTable([4, 2], [1.0, 1.0])


def test_profiling_calls_the_step_and_the_cache_is_reused(tmp_path):
    calls = []

    def step(tokens):
        calls.append(tokens)

    def clock():  # a fake clock where a step of t tokens takes t seconds
        return float(sum(calls))

    table = profile_step_rate(step, [1, 2, 4], warmup=1, repeats=3, clock=clock)
    assert calls == [1] * 4 + [2] * 4 + [4] * 4
    assert table.steps_per_s == pytest.approx([1.0, 0.5, 0.25])
    path = tmp_path / "sps.json"
    first = cached_step_rate(path, "tiny/cpu", step, [1, 2], clock=clock)
    n = len(calls)
    again = cached_step_rate(path, "tiny/cpu", step, [1, 2], clock=clock)
    assert again == first and len(calls) == n  # cached: the step is not run again
    cached_step_rate(path, "other-model", step, [1, 2], clock=clock)
    assert len(calls) > n  # a different key profiles afresh
