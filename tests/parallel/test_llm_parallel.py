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


def _llm_rank(rank, world, layouts):
    ctx = init_distributed(timeout_s=60)
    try:
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(parallel_test_config()).eval()
        kw = dict(page_size=PAGE_SIZE, max_num_seqs=4, max_model_len=64, device="cpu")
        # An 8-token budget chunks the long prompts and mixes decodes with prefill chunks in one step.
        chunked = dict(kw, max_num_batched_tokens=8)
        want = llm_mod.LLM(copy.deepcopy(model), **chunked).generate(PROMPTS, GREEDY, use_tqdm=False)
        ref_seen, ref_tokens = _verify_steps(llm_mod.LLM(copy.deepcopy(model), **kw), want)
        out = {}
        for tp, cp in layouts:
            par = dict(tensor_parallel_size=tp, context_parallel_size=cp)
            helix = llm_mod.LLM(copy.deepcopy(model), **par, **chunked)
            got = helix.generate(PROMPTS, GREEDY, use_tqdm=False)
            seen, tokens = _verify_steps(llm_mod.LLM(copy.deepcopy(model), **par, **kw), want)
            (phases, verify_logits), (_, ref_verify_logits) = seen[-1], ref_seen[-1]
            rel = ((verify_logits - ref_verify_logits).abs().max() / ref_verify_logits.abs().max()).item()
            out[tp, cp] = {
                "outputs": [o.token_ids for o in got],
                "reference": [o.token_ids for o in want],
                "verify_phases": phases,
                "verify_rel": rel,
                "verify_tokens_equal": tokens == ref_tokens,
                "bytes_per_step": [m.bytes_sent for m in helix.metrics],
            }
        return out
    finally:
        ctx.close()


@pytest.mark.parametrize("layouts", [[(1, 2), (2, 1)], [(1, 3)], [(2, 2), (1, 4)]], ids=["world2", "world3", "world4"])
def test_llm_helix_equals_single_process(layouts):
    world = layouts[0][0] * layouts[0][1]
    per_rank = check_all_ok(spawn(_llm_rank, world, layouts), world)
    for layout in layouts:
        results = [r[layout] for r in per_rank]
        assert results[0]["outputs"] == results[0]["reference"], layout
        assert all(r["outputs"] == [] for r in results[1:])  # rank 0 returns the outputs
        for r in results:
            assert r["verify_phases"] == [Phase.VERIFY] * len(PROMPTS)
            assert r["verify_rel"] <= 1e-5 and r["verify_tokens_equal"], (layout, r)
            assert all(b > 0 for b in r["bytes_per_step"])
