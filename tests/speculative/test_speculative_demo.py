"""Greedy speculative decoding on the shipped demo model (trained weights, KDA and MLA layers) equals plain greedy
token for token: n-gram proposals and a DSpark drafter (random weights: exactness must not depend on its quality),
k in {1, 3, 5}, 16-token pages so that verify groups straddle them."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.assets import demo_model_dir
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.speculative.dspark import DSparkConfig, DSparkDrafter

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\nclass Path:\n    def __init__(self, path):\n        self.path = path\n",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PAGE = 16


@pytest.fixture(scope="module")
def plain():
    return [o.token_ids for o in LLM(dtype=torch.float32, device="cpu", page_size=PAGE).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = DSparkConfig(
        vocab_size=8192, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, head_dim=64,
        intermediate_size=512, target_layer_ids=[1, 5], target_num_hidden_layers=8, block_size=6,
        mask_token_id=2, markov_rank=8,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("demo-drafter")
    DSparkDrafter(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("method", ["ngram", "dspark"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_demo_model_speculative_greedy_equals_plain(plain, drafter_dir, method, k):
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "dspark":
        spec["model"] = str(drafter_dir)
    llm = LLM(demo_model_dir(), dtype=torch.float32, device="cpu", page_size=PAGE, speculative_config=spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert llm.speculative.metrics.rounds > 0  # drafts were verified, not skipped


def test_shipped_drafter_is_the_default_and_exact(plain):
    """DSpark without a `model` on the demo model takes the drafter shipped beside it (assets/demo/drafter)."""
    spec = {"method": "dspark", "num_speculative_tokens": 5}
    llm = LLM(demo_model_dir(), dtype=torch.float32, device="cpu", page_size=PAGE, speculative_config=spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert llm.speculative.metrics.rounds > 0
    assert llm.speculative.metrics.tau > 2  # the trained drafter: rounds accepted drafts


@pytest.mark.parametrize("batch", [1, 2])
def test_drafts_launched_ahead_are_served_only_when_the_host_agrees(plain, batch, monkeypatch):
    """Each greedy round launches the next round's drafts from the device's own acceptance (`draft_ahead`);
    they are served when the anchors and positions the device derived equal the host's. With the device's
    view corrupted (every argmax id moved by one), none is served and the output is still plain greedy."""
    spec = {"method": "dspark", "num_speculative_tokens": 5}
    llm = LLM(demo_model_dir(), dtype=torch.float32, device="cpu", page_size=PAGE, speculative_config=spec)
    proposer = llm.speculative.proposer
    assert [o.token_ids for o in llm.generate(PROMPTS[:batch], GREEDY)] == plain[:batch]
    assert proposer.served_ahead >= llm.speculative.metrics.rounds // batch - 2  # all but the first and last few

    llm = LLM(demo_model_dir(), dtype=torch.float32, device="cpu", page_size=PAGE, speculative_config=spec)
    proposer = llm.speculative.proposer
    draft_ahead = proposer.draft_ahead
    monkeypatch.setattr(proposer, "draft_ahead", lambda ids, best, drafts: draft_ahead(ids, _off_by_one(best), drafts))
    assert [o.token_ids for o in llm.generate(PROMPTS[:batch], GREEDY)] == plain[:batch]
    assert proposer.drafted_ahead > 0 and proposer.served_ahead == 0


@pytest.mark.parametrize("batch", [1, 2])
def test_verify_steps_context_writes_go_with_the_next_draft(plain, batch, monkeypatch):
    """A greedy round's verify step leaves its context write to `draft_ahead`, which writes it with the device's
    acceptance and the next draft: only steps that are not a whole round's verify groups (prefills, groups cut
    short near max_tokens) write on their own, and the output is still plain greedy."""
    spec = {"method": "dspark", "num_speculative_tokens": 5}
    llm = LLM(demo_model_dir(), dtype=torch.float32, device="cpu", page_size=PAGE, speculative_config=spec)
    proposer, own = llm.speculative.proposer, []
    write = proposer._write
    monkeypatch.setattr(proposer, "_write", lambda *step: own.append(list(step[3])) or write(*step))
    assert [o.token_ids for o in llm.generate(PROMPTS[:batch], GREEDY)] == plain[:batch]
    assert proposer.drafted_ahead > 0
    assert [counts for counts in own if counts == [6] * len(counts)] == []  # no whole round wrote on its own
    assert any(counts == [len(ids) for ids in llm.tokenizer(PROMPTS[:batch])["input_ids"]] for counts in own)


def _off_by_one(tokens: torch.Tensor) -> torch.Tensor:
    """Every token id moved by one, staying inside the vocab."""
    return torch.where(tokens > 0, tokens - 1, tokens + 1)
