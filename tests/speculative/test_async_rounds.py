"""Asynchronous DSpark rounds (`speculative.async_rounds`): each round staged on the device from the one before and
launched before the host reads it give plain greedy decoding's tokens and the synchronous rounds' acceptance.

CPU: the demo model and its shipped drafter in fp32, verify steps run from the graphs' static buffers
(`StepGraphs(use_graphs=False)`, what a replay runs), the round's tail eagerly; every acceptance length occurs (the
trained drafter), requests stop at different rounds, one on a stop token in the middle of a round. GPU (`-m gpu`):
the same with every graph on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.assets import demo_model_dir
from kimi_helix.engine import LLM, SamplingParams, cache
from kimi_helix.engine.cuda_graph import StepGraphs
from kimi_helix.kernels.accept_stage import accept_and_stage
from kimi_helix.kernels.device import interpreting
from kimi_helix.kernels.state_restore import restore_verified_states
from kimi_helix.modeling.batch import Phase
from kimi_helix.speculative import async_rounds
from kimi_helix.speculative.async_rounds import AsyncRounds
from kimi_helix.speculative.dspark import DSparkDrafter

from ..modeling.conftest import randomize_router_bias, tiny_kwargs
from .conftest import tiny_drafter_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from demo_prompts import corpus_prompts  # noqa: E402


@pytest.fixture(scope="module")
def prompts():
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir(), trust_remote_code=False)
    return corpus_prompts(tokenizer, "heldout", 3, 24, 7)


def _llm(device: str, k: int | None, overlap: bool) -> LLM:
    spec = None if k is None else {"method": "dspark", "num_speculative_tokens": k}
    llm = LLM(demo_model_dir(), dtype=torch.float32, device=device, page_size=16, max_num_seqs=4,
              speculative_config=spec, async_scheduling=overlap)  # fmt: skip
    if device == "cpu" and k is not None:
        llm.runner.graphs = StepGraphs(llm.runner, use_graphs=False, max_draft_tokens=k)
    return llm


def _run(llm: LLM, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]


def _check(device: str, prompts, k: int):
    """Three requests of different lengths, one stopping on a token it emits mid-round: the asynchronous rounds
    equal plain greedy and the synchronous rounds' metrics, and leave no page mapped."""
    lengths = [48, 20, 33]
    plain_llm = _llm(device, None, False)
    greedy = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    first = _run(plain_llm, prompts, greedy)[0][0]
    stop = first[30]  # request 0 stops at its first occurrence of this token (a round that another runs past)
    params = [SamplingParams(max_tokens=lengths[0], temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
              *greedy[1:]]  # fmt: skip
    plain = _run(plain_llm, prompts, params)
    assert plain[0][1] == "stop" and len(plain[0][0]) <= 31
    sync, overlapped = _llm(device, k, False), _llm(device, k, True)
    assert sync.async_rounds is None and isinstance(overlapped.async_rounds, AsyncRounds)
    assert _run(sync, prompts, params) == plain
    assert _run(overlapped, prompts, params) == plain
    rounds = overlapped.async_rounds
    assert rounds.disabled is None and rounds.entered >= 1 and rounds.launched >= 3
    want, got = sync.speculative.metrics, overlapped.speculative.metrics
    assert (got.rounds, got.emitted, got.accepted_at) == (want.rounds, want.emitted, want.accepted_at)
    assert min(got.acceptance_by_position) > 0 and max(got.acceptance_by_position) < 1  # partial and full rounds
    ledger = overlapped.cache.ledger
    assert ledger.pages_in_use == sum(len(b.pages) for b in ledger.seqs.values()) and len(ledger.seqs) == 1
    assert overlapped.speculative.proposer.cache.length == {}


@pytest.mark.parametrize(("which", "max_tokens"), [(1, 21), (2, 33)])  # waiting for room left synchronous rounds
def test_async_rounds_run_until_max_tokens(prompts, which, max_tokens):
    """One request: after its prefill every round runs asynchronously, the last ones too (their drafts past
    `max_tokens` write the graphs' scratch page), with plain greedy's tokens and the synchronous rounds' metrics."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = [prompts[which]]
    plain = _run(_llm("cpu", None, False), prompt, params)
    sync, overlapped = _llm("cpu", 5, False), _llm("cpu", 5, True)
    scheduled = []
    schedule = overlapped.scheduler.schedule
    overlapped.scheduler.schedule = lambda: scheduled.append(step := schedule()) or step
    assert _run(sync, prompt, params) == plain
    assert _run(overlapped, prompt, params) == plain
    phases = [phase for step in scheduled for phase in step.phases]
    assert Phase.PREFILL in phases and Phase.VERIFY not in phases  # no synchronous round
    want, got = sync.speculative.metrics, overlapped.speculative.metrics
    assert (got.rounds, got.emitted, got.proposed_at, got.accepted_at) == (
        want.rounds, want.emitted, want.proposed_at, want.accepted_at)  # fmt: skip
    ledger = overlapped.cache.ledger
    assert len(ledger.seqs) == 1 and ledger.pages_in_use == len(next(iter(ledger.seqs.values())).pages)


def test_drafts_past_a_reservation_leave_other_pages_alone(prompts):
    """Request 1 reserves exactly three pages (24 + 25 - 1 tokens) and its last rounds draft past them while
    request 0, whose pages were mapped first, decodes on: those drafts must land on the scratch page."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (40, 25)]
    plain = _run(_llm("cpu", None, False), prompts[:2], params)
    llm = _llm("cpu", 5, True)
    ledger, rounds = llm.cache.ledger, llm.async_rounds
    assert ledger.pages_for(len(prompts[1]) + 25 - 1) * 16 == len(prompts[1]) + 25 - 1
    pages_written = []
    tail = rounds._tail

    def checked_tail(logits):  # the verify step just launched wrote its tokens at these slots
        slots = rounds._fields.slot_mapping[: len(rounds._step.requests) * 6].view(-1, 6) // 16
        for r, row in zip(rounds._step.requests, slots.tolist()):
            own = set(ledger.seqs[r.request_id].pages)
            pages_written.append((set(row) - own) - {llm.runner.graphs.scratch_page})
        tail(logits)

    rounds._tail = checked_tail
    assert _run(llm, prompts[:2], params) == plain
    assert len(pages_written) >= 6 and not any(pages_written)
    assert rounds.launched >= 3


def test_a_batch_that_changes_near_max_tokens_runs_its_last_rounds_synchronously(tmp_path):
    """A random drafter on a random model: requests end at different rounds, and each end changes the batch; the
    rest re-enter with few tokens left, where an entering round (staged on the host) may not write past a
    request's reservation, so they finish synchronously, with plain greedy's tokens."""
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs())).eval()
    randomize_router_bias(model)
    cfg = model.config
    drafter = tiny_drafter_config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, mask_token_id=cfg.vocab_size - 1, block_size=5
    )
    DSparkDrafter(drafter).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 100, 1, 65)]
    # about a token a round: when request 0 ends, the others have three or four tokens left
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 28, 28, 28)]
    plain = _run(LLM(model, page_size=16), prompts, params)
    spec = {"method": "dspark", "model": str(tmp_path), "num_speculative_tokens": 5}
    llm = LLM(model, page_size=16, speculative_config=spec, async_scheduling=True)
    llm.runner.graphs = StepGraphs(llm.runner, use_graphs=False, max_draft_tokens=5)
    scheduled = []
    schedule = llm.scheduler.schedule
    llm.scheduler.schedule = lambda: scheduled.append(step := schedule()) or step
    assert _run(llm, prompts, params) == plain
    assert llm.async_rounds.launched >= 10 and Phase.VERIFY in [p for step in scheduled for p in step.phases]


@pytest.mark.parametrize("k", [3, 5])
def test_async_rounds_equal_plain_greedy_and_the_sync_rounds(prompts, k):
    _check("cpu", prompts, k)


def test_async_rounds_with_the_triton_bookkeeping(prompts, monkeypatch):
    """The round's acceptance, staging and KDA rollback through their Triton kernels (the interpreter here; the
    model's own ops keep the CPU's torch references)."""
    if not interpreting():
        pytest.skip("Triton runs on the CPU only under TRITON_INTERPRET=1")
    for module, op in ((async_rounds, accept_and_stage), (cache, restore_verified_states)):
        monkeypatch.setattr(module, op.__name__, lambda *args, backend=None, op=op: op(*args, backend="triton"))
    _check("cpu", prompts, 3)


@pytest.mark.gpu
def test_async_rounds_with_graphs_equal_plain_greedy_fp32(prompts):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check("cuda", prompts, 5)
    llm = _llm("cuda", 5, True)
    _run(llm, prompts[:1], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert llm.async_rounds._tails, "no CUDA graph of the round's tail was captured"
