"""A tiny random target (the `tiny` preset), a drafter fitted to it and a proposer that forces partial acceptance,
shared by the speculative tests."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.modeling import KimiK3ForCausalLM
from kimi_helix.presets import get_preset
from kimi_helix.speculative.dspark import DSparkConfig, DSparkDrafter
from kimi_helix.speculative.proposers import Proposal, Proposer


def tiny_drafter_config(**kw) -> DSparkConfig:
    base = dict(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        intermediate_size=128,
        target_layer_ids=[0, 2],
        target_num_hidden_layers=4,
        block_size=4,
        mask_token_id=258,
        markov_rank=8,
    )
    return DSparkConfig(**{**base, **kw})


@pytest.fixture
def target():
    torch.manual_seed(0)
    return KimiK3ForCausalLM(get_preset("tiny")).eval()


@pytest.fixture
def drafter(target):
    torch.manual_seed(1)
    d = DSparkDrafter(tiny_drafter_config()).eval()
    d.bind_target(target)
    return d


class OracleProposer(Proposer):
    """Proposes the true greedy continuation with one wrong token at a position that cycles through 0..k (k: all
    right), so every acceptance length 0..k occurs; requests in `plain_ids` get no drafts (plain decodes)."""

    name = "oracle"

    def __init__(self, oracle, plain_ids=(), vocab=256):
        self.oracle, self.plain_ids, self.vocab, self.rounds = oracle, set(plain_ids), vocab, {}

    def propose(self, requests):
        out = []
        for r in requests:
            if r.seq_id in self.plain_ids:
                out.append(Proposal([]))
                continue
            done = len(r.token_ids) - len(self.oracle[r.seq_id]["prompt"])
            drafts = self.oracle[r.seq_id]["out"][done : done + r.num_tokens]
            bad = self.rounds.get(r.seq_id, 0) % (r.num_tokens + 1)
            self.rounds[r.seq_id] = self.rounds.get(r.seq_id, 0) + 1
            out.append(Proposal([(t + 1) % self.vocab if j == bad else t for j, t in enumerate(drafts)]))
        return out
