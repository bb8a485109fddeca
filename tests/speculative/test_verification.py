"""Verification: greedy exact match equals plain greedy; at T=1 rejection sampling reproduces the target's
distribution (chi-square) for both proposers' draft distributions, and a deliberately biased verifier fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kimi_helix.engine.sampling import SamplingParams
from kimi_helix.speculative.dspark import DSparkDrafter, SlotContext
from kimi_helix.speculative.proposers import NgramProposer, ProposalRequest
from kimi_helix.speculative.verification import VerifyResult, accept_greedy, target_probs, verify, verify_greedy

from .conftest import tiny_drafter_config

V = 6
T1 = SamplingParams(temperature=1.0)


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities (flattened); the upper tail of chi2(df = cells - 1)."""
    counts, probs = counts.flatten().double(), expected_probs.flatten().double()
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def test_greedy_matches_plain_greedy_at_every_mismatch_position():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    best = logits.argmax(-1).tolist()
    for j in range(5):  # drafts agree up to position j, then differ (j = 4: all four agree)
        drafts = best[:j] + [(best[j] + 1) % 50] * (4 - j) if j < 4 else best[:4]
        res = verify_greedy(drafts, logits)
        assert res.num_accepted == j and res.tokens == best[: j + 1]
    assert verify_greedy([], logits[:1]) == VerifyResult([best[0]], 0)
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_greedy([1, 2], logits)


def test_greedy_ties_break_like_sampling():
    logits = torch.zeros(2, 8)
    logits[0, 3] = logits[0, 5] = 1.0
    assert verify_greedy([5], logits).tokens == [3]  # the first index among ties, as `sample` takes it


def _tables(seed: int, scale: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(V, generator=g) * scale, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * scale, -1)  # p2[y1] = target's next row after y1
    bonus = torch.randn(V, V, V, generator=g)
    return p1, p2, bonus


def _run_chain(verifier, draw_drafts, p1, p2, bonus, n: int, seed: int) -> torch.Tensor:
    """Counts [V, V] of the first two emitted tokens over n rounds with k=2 drafts; a round that emits one token
    is completed by the target's own next-step sample, as decoding would."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(n):
        drafts, q = draw_drafts(gen)
        logits = torch.stack([p1.log(), p2[drafts[0]].log(), bonus[drafts[0], drafts[1]]])
        res = verifier(drafts, q, logits, T1, gen)
        y = res.tokens[:2]
        if len(y) == 1:
            y.append(int(torch.multinomial(p2[y[0]], 1, generator=gen)))
        counts[y[0], y[1]] += 1
    return counts


def _biased_verify(draft_tokens, draft_probs, target_logits, params, generator):
    """Wrong on purpose: after a rejection it resamples from p instead of the residual max(p - q, 0)."""
    p = target_probs(target_logits, params)
    for i, x in enumerate(draft_tokens):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand((), generator=generator)) * q_x >= float(p[i, x]):
            return VerifyResult([*draft_tokens[:i], int(torch.multinomial(p[i], 1, generator=generator))], i)
    k = len(draft_tokens)
    return VerifyResult([*draft_tokens, int(torch.multinomial(p[k], 1, generator=generator))], k)


def _ngram_drafts():
    """The ngram proposer's (deterministic) drafts for a context whose suffix [1, 2] occurred before [3, 1]."""
    (proposal,) = NgramProposer(1, 2).propose([ProposalRequest(0, [1, 2, 3, 1, 4, 1, 2], 2)])
    drafts = proposal.token_ids
    assert drafts == [3, 1] and proposal.probs is None
    return lambda gen: (drafts, None)


class _ToyTarget(nn.Module):
    """Only what a drafter shares with its target: an embedding and an LM head over the toy vocabulary."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(V, 64), nn.Linear(64, V, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def _dspark_drafts():
    """Draft tables of a random toy DSpark drafter: slot 1's q1 and, through the Markov head, slot 2's
    q2(. | x1) for every x1; checked against `draft()` itself, then sampled from."""
    torch.manual_seed(5)
    drafter = DSparkDrafter(tiny_drafter_config(vocab_size=V, mask_token_id=V - 1, markov_rank=4)).eval()
    with torch.no_grad():
        drafter.markov_embed.weight.normal_()  # a Markov correction strong enough to matter
        drafter.markov_proj.weight.normal_(0.0, 0.5)
    drafter.bind_target(_ToyTarget())
    feats = torch.randn(1, 5, 128)
    ctx = drafter.context_keys_values(feats, torch.arange(5)[None])
    valid = torch.ones(1, 5, dtype=torch.bool)
    anchor, pos = torch.tensor([2]), torch.tensor([5])
    with torch.no_grad():
        hidden = drafter.backbone(torch.tensor([[2, V - 1, V - 1, V - 1]]), pos, ctx, torch.arange(5)[None], valid)
        base = drafter._io()[1](hidden)[0]
        q1 = torch.softmax(base[0] + drafter.markov_bias(anchor)[0], -1)
        q2 = torch.softmax(base[1][None] + drafter.markov_bias(torch.arange(V)), -1)
    context = SlotContext(ctx, torch.tensor([0]), pos)  # the cache's path: the rows read in place
    draft = drafter.draft(anchor, pos, context, 2, [1.0], [torch.Generator().manual_seed(0)])
    torch.testing.assert_close(draft.probs[0, 0], q1)
    torch.testing.assert_close(draft.probs[0, 1], q2[draft.tokens[0, 0]])
    assert (q2 - q2.mean(0)).abs().max() > 0.05  # slot 2 really depends on the sampled slot 1

    def draw(gen):
        x1 = int(torch.multinomial(q1, 1, generator=gen))
        x2 = int(torch.multinomial(q2[x1], 1, generator=gen))
        return [x1, x2], torch.stack([q1, q2[x1]])

    return draw


@pytest.mark.parametrize("proposer", ["ngram", "dspark"])
def test_rejection_sampling_keeps_the_target_distribution(proposer):
    p1, p2, bonus = _tables(seed=1)
    draw = _ngram_drafts() if proposer == "ngram" else _dspark_drafts()
    expected = p1[:, None] * p2
    counts = _run_chain(verify, draw, p1, p2, bonus, n=4000, seed=2)
    assert chi_square_p_value(counts, expected) > 1e-3
    biased = _run_chain(_biased_verify, draw, p1, p2, bonus, n=4000, seed=2)
    assert chi_square_p_value(biased, expected) < 1e-6


def test_seeded_verification_repeats_and_uses_only_its_generator():
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    q = torch.softmax(torch.randn(3, 30), -1)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    runs = [verify([1, 2, 3], q, logits, params, torch.Generator().manual_seed(7)) for _ in range(3)]
    torch.rand(100)  # the global generator is never read
    assert runs[0] == runs[1] == runs[2] == verify([1, 2, 3], q, logits, params, torch.Generator().manual_seed(7))


def test_top_k_is_respected_by_the_correction():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        res = verify([3], None, logits, params, gen)  # token 3 is outside the top 2: always rejected
        assert res.num_accepted == 0 and res.tokens[0] in (0, 1)


def test_accept_greedy_takes_the_matching_prefix_then_the_first_mismatch():
    assert accept_greedy([3, 4, 5], [3, 4, 9, 1]) == VerifyResult([3, 4, 9], 2)
    assert accept_greedy([3, 4], [3, 4, 7]) == VerifyResult([3, 4, 7], 2)  # every draft kept, then the bonus
    assert accept_greedy([], [6]) == VerifyResult([6], 0)
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_greedy([3, 4], [3, 4])
