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

from kimi_helix.assets import demo_model_dir
from kimi_helix.engine import LLM, SamplingParams, cache
from kimi_helix.engine.cuda_graph import StepGraphs
from kimi_helix.kernels.accept_stage import accept_and_stage
from kimi_helix.kernels.device import interpreting
from kimi_helix.kernels.state_restore import restore_verified_states
from kimi_helix.speculative import async_rounds
from kimi_helix.speculative.async_rounds import AsyncRounds

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
