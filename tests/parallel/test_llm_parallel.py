"""`LLM(model, tensor_parallel_size=T, context_parallel_size=C)` on gloo ranks equals the one-process `LLM`: greedy
outputs of a batch of prompts shorter than, equal to and many times a page (chunked prefill, mixed steps), and the
logits of verify groups built by the runner's verify phase that straddle pages (on some ranks, none of a group's
tokens is owned)."""

import copy

import pytest
import torch

from kimi_helix.engine import llm as llm_mod
from kimi_helix.engine.sampling import SamplingParams
from kimi_helix.modeling.batch import Phase
from kimi_helix.modeling.model import KimiK3ForCausalLM
from kimi_helix.parallel.distributed import init_distributed

from .harness import PAGE_SIZE, check_all_ok, parallel_test_config, spawn

PROMPTS = [[5, 9, 2], [7, 1, 3, 8], list(range(10, 27)), [3, 3, 4, 4, 5, 5, 6, 6, 7]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DRAFTS = 3


def _record(llm):
    """Keep every step's runner logits and phases."""
    seen = []
    run = llm.runner.run

    def recording(step):
        out = run(step)
        seen.append((list(step.phases), out.logits.clone()))
        return out

    llm.runner.run = recording
    return seen


def _verify_steps(llm, reference_outputs):
    """Prefill, then one verify step whose drafts are the reference's next greedy tokens (all accepted)."""
    seen = _record(llm)
    requests = [llm._make_request(p, GREEDY) for p in PROMPTS]
    for r in requests:
        llm.scheduler.add(r)
    llm.step()
    for r, ref in zip(requests, reference_outputs):
        r.draft_token_ids = ref.token_ids[len(r.output_ids) : len(r.output_ids) + DRAFTS]
    llm.step()
    return seen, [r.output_ids for r in requests]


def _llm_rank(rank, world, tp, cp):
    ctx = init_distributed(timeout_s=60)
    try:
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(parallel_test_config()).eval()
        kw = dict(page_size=PAGE_SIZE, max_num_seqs=4, max_model_len=64, device="cpu")
        # An 8-token budget chunks the long prompts and mixes decodes with prefill chunks in one step.
        chunked = dict(kw, max_num_batched_tokens=8)
        want = llm_mod.LLM(copy.deepcopy(model), **chunked).generate(PROMPTS, GREEDY, use_tqdm=False)
        helix = llm_mod.LLM(copy.deepcopy(model), tensor_parallel_size=tp, context_parallel_size=cp, **chunked)
        got = helix.generate(PROMPTS, GREEDY, use_tqdm=False)
        ref_seen, ref_tokens = _verify_steps(llm_mod.LLM(copy.deepcopy(model), **kw), want)
        seen, tokens = _verify_steps(
            llm_mod.LLM(copy.deepcopy(model), tensor_parallel_size=tp, context_parallel_size=cp, **kw), want
        )
        (phases, verify_logits), (_, ref_verify_logits) = seen[-1], ref_seen[-1]
        rel = ((verify_logits - ref_verify_logits).abs().max() / ref_verify_logits.abs().max()).item()
        return {
            "outputs": [o.token_ids for o in got],
            "reference": [o.token_ids for o in want],
            "verify_phases": phases,
            "verify_rel": rel,
            "verify_tokens_equal": tokens == ref_tokens,
            "bytes_per_step": [m.bytes_sent for m in helix.metrics],
        }
    finally:
        ctx.close()


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2), (1, 3)])
def test_llm_helix_equals_single_process(tp, cp):
    results = check_all_ok(spawn(_llm_rank, tp * cp, tp, cp), tp * cp)
    assert results[0]["outputs"] == results[0]["reference"]
    assert all(r["outputs"] == [] for r in results[1:])  # rank 0 returns the outputs
    for r in results:
        assert r["verify_phases"] == [Phase.VERIFY] * len(PROMPTS)
        assert r["verify_rel"] <= 1e-5 and r["verify_tokens_equal"], r
        assert all(b > 0 for b in r["bytes_per_step"])
