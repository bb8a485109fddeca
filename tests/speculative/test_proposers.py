"""Proposers: prompt lookup (min/max n-gram) and the DSpark proposer's draft context."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.speculative.dspark import TargetFeatureCapture
from kimi_helix.speculative.proposers import DSparkProposer, NgramProposer, Proposal, ProposalRequest, Proposer


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 2, 1, 3, [3, 4]),  # suffix [1, 2] seen at 0
        ([1, 2, 3, 4, 1, 2], 5, 1, 3, [3, 4, 1, 2]),  # fewer than k tokens follow
        ([5, 1, 9, 7, 1, 9, 8, 1, 9], 2, 2, 2, [8, 1]),  # the most recent occurrence wins
        ([5, 1, 9, 7, 3, 9], 2, 2, 3, []),  # bigram [3, 9] never occurred; unigrams not allowed
        ([5, 1, 9, 7, 3, 9], 2, 1, 3, [7, 3]),  # the unigram [9] did
        ([4, 4, 4, 4], 3, 1, 4, [4]),  # the longest earlier match: [4, 4, 4] at 0, followed by one token
        ([7], 3, 1, 2, []),
    ],
)
def test_ngram_lookup(tokens, k, min_n, max_n, expected):
    (p,) = NgramProposer(min_n, max_n).propose([ProposalRequest(0, tokens, k)])
    assert p.token_ids == expected and p.probs is None


def test_ngram_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(3, 2)


def test_custom_proposer_follows_the_protocol():
    class Repeat(Proposer):
        name = "repeat"

        def propose(self, requests):
            return [Proposal([r.token_ids[-1]] * r.num_tokens) for r in requests]

    (p,) = Repeat().propose([ProposalRequest(0, [3, 8], 2)])
    assert p.token_ids == [8, 8]
    Repeat().observe(0, 0, torch.zeros(2, 4))  # the defaults are no-ops
    Repeat().rollback(0, 1)


def _observe_prompt(target, proposer, seq_id, ids):
    with TargetFeatureCapture(target, proposer.target_layer_ids) as cap:
        target(torch.tensor([ids]))
        proposer.observe(seq_id, 0, cap.pop())


def test_dspark_proposer_batches_like_single_requests_and_rolls_back(target, drafter):
    torch.manual_seed(0)
    prop = DSparkProposer(drafter)
    a, b = torch.randint(0, 256, (9,)).tolist(), torch.randint(0, 256, (5,)).tolist()
    _observe_prompt(target, prop, 1, a[:-1])  # the anchor (last token) is not in the context
    _observe_prompt(target, prop, 2, b[:-1])
    both = prop.propose([ProposalRequest(1, a, 3), ProposalRequest(2, b, 2)])
    one = prop.propose([ProposalRequest(1, a, 3)])[0]
    two = prop.propose([ProposalRequest(2, b, 2)])[0]
    assert both[0].token_ids == one.token_ids and len(one.token_ids) == 3
    assert both[1].token_ids == two.token_ids and len(two.token_ids) == 2
    torch.testing.assert_close(both[0].confidence, one.confidence)
    assert all(0 <= c <= 1 for c in one.confidence)

    # Rolling the context back to 5 tokens drafts exactly what a 5-token context drafts.
    prop.rollback(1, 5)
    assert prop.context_len(1) == 5
    _observe_prompt(target, prop, 3, a[:5])
    assert (
        prop.propose([ProposalRequest(1, a[:6], 2)])[0].token_ids
        == prop.propose([ProposalRequest(3, a[:6], 2)])[0].token_ids
    )
    with pytest.raises(ValueError, match="observe"):
        prop.propose([ProposalRequest(1, a, 2)])
    with pytest.raises(ValueError, match="start at 7"):
        prop.observe(1, 7, torch.zeros(1, 128))
    prop.release(1)
    assert prop.context_len(1) == 0
