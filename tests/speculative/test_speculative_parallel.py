"""Speculative decoding under Helix (cp=2) and tensor parallelism (tp=2) on gloo ranks: greedy output equals the
one-process plain greedy output token for token, for DSpark (a random drafter) and ngram with k in {1, 3}, for
partial acceptance forced at every position with a plain request in the batch, and under confidence scheduling;
unseeded sampling keeps the ranks in step (they all continue with rank 0's drafts and verdicts). Pages of 4 tokens
make verify groups straddle pages, so a group's tokens live on both cp ranks (per-token ownership and key bounds)."""

from __future__ import annotations

import copy

import pytest
import torch

from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.modeling import KimiK3ForCausalLM
from kimi_helix.parallel.distributed import init_distributed
from kimi_helix.speculative import UnsupportedConfigError
from kimi_helix.speculative.dspark import DSparkDrafter
from kimi_helix.speculative.scheduling import StepRateTable

from ..parallel.harness import PAGE_SIZE, check_all_ok, parallel_test_config, spawn
from .conftest import OracleProposer, tiny_drafter_config

PROMPTS = [[5, 9, 2, 5, 9], [7, 1, 3, 8, 7, 1, 3, 8, 7], list(range(10, 21))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)  # unseeded: the global RNG draws
KW = dict(page_size=PAGE_SIZE, max_num_seqs=4, max_model_len=48, device="cpu")


def _drafter_config():
    """A drafter for `parallel_test_config` (vocab 384, d 48, 4 layers)."""
    return tiny_drafter_config(
        vocab_size=384, hidden_size=48, num_attention_heads=4, head_dim=12, intermediate_size=64, mask_token_id=383
    )


def _oracle(plain):
    """Forces every acceptance length 0..k; request 1 stays a plain decode throughout."""
    return OracleProposer({i: {"prompt": p, "out": o} for i, (p, o) in enumerate(zip(PROMPTS, plain))}, [1], 384)


def _spec_rank(rank, world, tp, cp, specs, drafter_dir):
    ctx = init_distributed(timeout_s=60)
    try:
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(parallel_test_config()).eval()
        plain = [o.token_ids for o in LLM(copy.deepcopy(model), **KW).generate(PROMPTS, GREEDY, use_tqdm=False)]
        out = {}
        for name, spec in specs:
            if spec.get("model") == "DRAFTER":
                spec = {**spec, "model": drafter_dir}
            proposer = _oracle(plain) if spec["method"] == "custom" else None
            llm = LLM(
                copy.deepcopy(model),
                tensor_parallel_size=tp,
                context_parallel_size=cp,
                speculative_config=spec,
                proposer=proposer,
                **KW,
            )
            if name == "forced" and proposer is None:  # cp > 1 admits DSpark only: the oracle drafts behind it
                llm.speculative.proposer = _oracle(plain)
            if name == "sampled":
                torch.manual_seed(100 + rank)  # the ranks' global RNGs differ, as unrelated processes' may
            if name == "confident":
                # Each rank profiled its own table; replace them with rank-dependent ones that do not hang on CPU
                # timings: on rank 0 drafts cost nothing (Algorithm 1 admits them), on rank 1 they cost so much that
                # it alone would admit none. Rank 0's lengths must hold on both.
                steep = [1.0, 1e-6] if rank else [1.0, 1.0]
                llm.speculative.step_rate = StepRateTable([1, 64], steep)
            got = llm.generate(PROMPTS, SAMPLED if name == "sampled" else GREEDY, use_tqdm=False)
            m = llm.speculative.metrics
            out[name] = {"tokens": [o.token_ids for o in got], "rounds": m.rounds, "by_pos": m.acceptance_by_position}
        return plain, out
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("drafter")
    DSparkDrafter(_drafter_config()).save_pretrained(path)
    return str(path)


def _dspark(k):
    return {"method": "dspark", "model": "DRAFTER", "num_speculative_tokens": k}


def _ngram(k):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


LAYOUTS = {
    "cp2": (
        1,
        2,
        [
            ("dspark1", _dspark(1)),
            ("dspark3", _dspark(3)),
            ("forced", _dspark(3)),
            ("sampled", _dspark(3)),
            # the ranks' step-rate tables differ; the lengths Algorithm 1 gives on rank 0 hold everywhere
            ("confident", {**_dspark(3), "confidence_scheduling": True}),
        ],
    ),
    "tp2": (
        2,
        1,
        [
            ("dspark3", _dspark(3)),
            ("ngram1", _ngram(1)),
            ("ngram3", _ngram(3)),
            ("forced", {"method": "custom", "num_speculative_tokens": 3}),
            ("sampled", _dspark(3)),
        ],
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_speculative_greedy_equals_plain_greedy(layout, drafter_dir):
    tp, cp, specs = LAYOUTS[layout]
    (plain, out), (_, other) = check_all_ok(spawn(_spec_rank, 2, tp, cp, specs, drafter_dir), 2)
    for name, _ in specs:
        if name == "sampled":
            assert [len(t) for t in out[name]["tokens"]] == [SAMPLED.max_tokens] * len(PROMPTS)
        else:
            assert out[name]["tokens"] == plain, (layout, name)
        assert other[name]["tokens"] == []  # rank 0 returns the outputs
        # every rank verified the same rounds with the same acceptance (rank 0's drafts and verdicts)
        assert other[name]["rounds"] == out[name]["rounds"] > 0 and other[name]["by_pos"] == out[name]["by_pos"]
    assert all(0 < a < 1 for a in out["forced"]["by_pos"]), out["forced"]  # each position accepted and rejected


def test_cp_admits_dspark_chains_only(tmp_path):
    model = KimiK3ForCausalLM(parallel_test_config())
    with pytest.raises(UnsupportedConfigError, match="under cp=2 only a standalone DSpark linear chain"):
        LLM(model, context_parallel_size=2, speculative_config=_ngram(3), **KW)  # raised before joining any group
