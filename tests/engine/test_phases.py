"""Declared phases: each phase takes its own kernels in a mixed step, and mixed decode / prefill / verify steps give
the same tokens as separate runs and as `KimiK3ForCausalLM.generate`."""

import pytest
import torch

from kimi_helix import KimiK3Config
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.modeling import kda as kda_module
from kimi_helix.modeling import paged_mla
from kimi_helix.modeling.batch import ForwardBatch, Phase

from ..modeling.conftest import k3_kwargs, tiny_kwargs
from .test_llm import hf_greedy, make_model, prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)  # stops at EOS, as HF generate does


def test_hf_phases_are_inferred_and_engine_phases_are_checked():
    batch = ForwardBatch.build([5, 1, 1, 0], [0, 7, 0, 3], "cpu")
    assert batch.phases == [Phase.PREFILL, Phase.DECODE, Phase.PREFILL, Phase.PREFILL]
    with pytest.raises(
        ValueError, match=r"phases\[0\] is DECODE, which has exactly 1 new token, but seq_lens\[0\] = 3"
    ):
        ForwardBatch.build([3], [4], "cpu", phases=[Phase.DECODE])
    with pytest.raises(ValueError, match=r"phases\[0\] must be a Phase \(DECODE, VERIFY, PREFILL\), got 'decode'"):
        ForwardBatch.build([1], [4], "cpu", phases=["decode"])
    with pytest.raises(ValueError, match=r"phases \(1\) and seq_lens \(2\) differ"):
        ForwardBatch.build([1, 1], [4, 4], "cpu", phases=[Phase.DECODE])


def test_runs_group_consecutive_sequences_by_kernel_path():
    phases = [Phase.DECODE, Phase.VERIFY, Phase.PREFILL, Phase.PREFILL, Phase.DECODE]
    batch = ForwardBatch.build([1, 4, 6, 2, 1], [9, 9, 0, 5, 3], "cpu", phases=phases)
    runs = batch.runs()
    assert [(r.decode_path, r.seqs, r.tokens, r.attention_phase) for r in runs] == [
        (True, slice(0, 2), slice(0, 5), "verify"),
        (False, slice(2, 4), slice(5, 13), "prefill"),
        (True, slice(4, 5), slice(13, 14), "decode"),
    ]
    assert runs[1].batch.cu_seqlens.tolist() == [0, 6, 8] and runs[1].batch.positions.tolist()[-2:] == [5, 6]
    whole = ForwardBatch.build([1, 1], [3, 4], "cpu")
    assert whole.runs()[0].batch is whole


def spy(monkeypatch, module, name, calls, tokens_of):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append((name, tokens_of(args[0])))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def test_a_mixed_step_sends_decodes_and_verifies_to_the_decode_kernels(monkeypatch):
    calls = []
    spy(monkeypatch, paged_mla, "mla_decode", calls, lambda q: q.shape[0])
    spy(monkeypatch, paged_mla, "mla_prefill", calls, lambda q: q.shape[0])
    spy(monkeypatch, kda_module, "fused_recurrent_kda", calls, lambda q: q.shape[1])
    spy(monkeypatch, kda_module, "chunk_kda", calls, lambda q: q.shape[1])
    # the convs take q, k and v as channel groups: count the tokens of the first
    spy(monkeypatch, kda_module, "causal_conv1d_update", calls, lambda x: x[0].shape[0])
    spy(monkeypatch, kda_module, "causal_conv1d", calls, lambda x: x[0].shape[1])
    model = make_model()
    mixed = ForwardBatch.build([1, 4, 9], [6, 6, 3], "cpu", phases=[Phase.DECODE, Phase.VERIFY, Phase.PREFILL])
    llm = LLM(model, page_size=8)
    for i in range(3):
        llm.cache.ledger.admit(i, 16)
    with torch.no_grad():
        model.model.forward_packed(torch.randn(14, model.config.hidden_size), mixed, llm.cache.view([0, 1, 2]))
    n_mla, n_kda = model.config.layer_types.count("full_attention"), model.config.layer_types.count("linear_attention")
    counts = {key: calls.count(key) for key in set(calls)}
    # The verify group makes the decode run multi-token, so its conv takes the varlen kernel (no 1-token update).
    assert counts == {
        ("mla_decode", 5): n_mla,
        ("mla_prefill", 9): n_mla,
        ("fused_recurrent_kda", 5): n_kda,
        ("chunk_kda", 9): n_kda,
        ("causal_conv1d", 5): n_kda,
        ("causal_conv1d", 9): n_kda,
    }
    calls.clear()
    decode_only = ForwardBatch.build([1, 1], [15, 15], "cpu", phases=[Phase.DECODE, Phase.DECODE])
    with torch.no_grad():
        model.model.forward_packed(torch.randn(2, model.config.hidden_size), decode_only, llm.cache.view([0, 1]))
    assert {key: calls.count(key) for key in set(calls)} == {
        ("mla_decode", 2): n_mla,
        ("fused_recurrent_kda", 2): n_kda,
        ("causal_conv1d_update", 2): n_kda,
    }


def with_drafts(llm, oracle, k, corrupt=None):
    """Before each step give every decoding request the next k tokens of its oracle continuation as drafts
    (`corrupt(r, drafts)` may change them), so steps mix verify groups with decodes and prefill chunks."""
    schedule, seen = llm.scheduler.schedule, []

    def drafted():
        for r in llm.scheduler.running:
            if not r.prefilling:
                done = len(r.output_ids)
                drafts = oracle[r.request_id][done : done + k]
                r.draft_token_ids = corrupt(r, drafts) if corrupt else drafts
        step = schedule()
        seen.append(set(step.phases))
        return step

    llm.scheduler.schedule = drafted
    return seen


@pytest.mark.parametrize("kwargs", [tiny_kwargs(), k3_kwargs()], ids=["kimi-linear", "k3-style"])
def test_mixed_steps_equal_separate_runs_and_hf_generate(kwargs):
    model = make_model(kwargs)
    ps = prompts([7, 40, 3, 25, 61], seed=21)
    expected = [hf_greedy(model, p, 10) for p in ps]
    alone = [LLM(model, page_size=8).generate([p], GREEDY)[0].token_ids for p in ps]
    llm = LLM(model, page_size=8, max_num_batched_tokens=24)
    seen = with_drafts(llm, dict(enumerate(expected)), k=3)
    mixed = [o.token_ids for o in llm.generate(ps, GREEDY)]
    assert mixed == expected == alone
    assert {Phase.DECODE, Phase.VERIFY, Phase.PREFILL} in seen  # at least one step mixed all three


def test_rejected_drafts_roll_back_and_keep_the_tokens():
    """With MLA layers only the rollback is the cached length: wrong drafts at every verify change nothing."""
    kwargs = tiny_kwargs(linear_attn_config={**tiny_kwargs()["linear_attn_config"], "kda_layers": []})
    kwargs["linear_attn_config"]["full_attn_layers"] = [1, 2, 3, 4]
    assert set(KimiK3Config(**kwargs).layer_types) == {"full_attention"}
    model = make_model(kwargs)
    ps = prompts([5, 33, 18], seed=22)
    expected = [hf_greedy(model, p, 10) for p in ps]
    llm = LLM(model, page_size=8, max_num_batched_tokens=20)

    def corrupt(r, drafts):  # a wrong token at a position that moves with the request's progress
        bad = len(r.output_ids) % max(1, len(drafts))
        return [(t + 1) % 128 if j == bad else t for j, t in enumerate(drafts)]

    seen = with_drafts(llm, dict(enumerate(expected)), k=4, corrupt=corrupt)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == expected
    assert any(Phase.VERIFY in s for s in seen)


def test_rejected_drafts_with_kda_layers_roll_back_the_states():
    """KDA and conv states are cut back from the verify step's per-token states: wrong drafts change nothing."""
    model = make_model()
    (p,) = prompts([6], seed=23)
    expected = hf_greedy(model, p, 10)
    llm = LLM(model, page_size=8)
    with_drafts(llm, {0: [(t + 1) % 128 for t in expected]}, k=2)
    assert llm.generate([p], GREEDY)[0].token_ids == expected
