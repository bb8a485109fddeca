"""Graphed prefills (`engine.cuda_graph`, `modeling.batch.TailPadding`): a whole fresh prompt padded to a prefill
bucket gives the eager step's logits and leaves its sequence the eager states and latents, whatever the padding
rows hold; only prompts that fit a bucket and want only their last row's logits take a graph.

On the CPU with `StepGraphs(use_graphs=False)` (the static buffers a graph replays, without the capture), with the
torch references and with every kernel forced to Triton (under TRITON_INTERPRET=1); on the GPU with real graphs.
"""

from __future__ import annotations

import pytest
import torch

from kimi_helix.engine import SamplingParams
from kimi_helix.engine.cuda_graph import SCRATCH_SEQ_ID, GraphKey, StepGraphs, default_prefill_buckets
from kimi_helix.engine.runner import PrefillPadding
from kimi_helix.engine.scheduler import ScheduledStep
from kimi_helix.kernels.device import interpreting
from kimi_helix.modeling.batch import ForwardBatch, Phase, TailPadding

from .test_cuda_graph import GREEDY, _llm, _model, _pools


def _prompt(length: int) -> list[int]:
    return [(7 * j + length) % 120 + 3 for j in range(length)]


def _prefill(llm, prompt: list[int]):
    """Schedule and run one fresh prompt's prefill step: (its logits, its request)."""
    request = llm._make_request(prompt, GREEDY)
    llm.scheduler.add(request)
    step = llm.scheduler.schedule()
    assert step.phases == [Phase.PREFILL] and step.num_tokens == [len(prompt)]
    return llm.runner.run(step).logits.clone(), request


def _own(llm, request) -> tuple[set[int], set[int], list[int]]:
    """The request's state slot and pages, and the flat latent slots of its tokens."""
    blocks, ps = llm.cache.ledger.seqs[request.request_id], llm.cache.ledger.page_size
    slots = [blocks.pages[p // ps] * ps + p % ps for p in range(request.num_computed)]
    return {blocks.slot}, set(blocks.pages), slots


@pytest.mark.parametrize(
    "device,backend",
    [("cpu", "torch"), ("cpu", "triton"), pytest.param("cuda", "triton", marks=pytest.mark.gpu)],
    ids=["static-buffers-cpu-torch", "static-buffers-cpu-triton", "graphs-gpu"],  # the references sync: no capture
)
@pytest.mark.parametrize("length", [1, 5, 16, 17, 32], ids=lambda n: f"T{n}")
def test_graph_prefill_equals_eager(device, backend, length):
    """Prompts below, at and just past a bucket's edge (buckets 16 and 32): the graphed prefill's logits, the
    sequence's conv and recurrent states and its latents equal the eager step's, although every other slot and page
    (the scratch sequence's included) holds noise; and nothing outside the sequence and the scratch changes."""
    if backend == "triton" and device == "cpu" and not interpreting():
        pytest.skip("Triton runs on the CPU only under TRITON_INTERPRET=1")
    model = _model(device)
    engine = dict(kernel_backend=backend, attention_backend=backend)
    eager = _llm(model, False, **engine)
    want_logits, request = _prefill(eager, _prompt(length))
    slot, _, latent_slots = _own(eager, request)
    want = {name: t[list(slot) if not name.startswith("pages") else latent_slots] for name, t in _flat(eager).items()}

    llm = _llm(model, True, **engine)
    request = llm._make_request(_prompt(length), GREEDY)
    llm.scheduler.add(request)
    step = llm.scheduler.schedule()
    graphs = llm.runner.graphs
    key = GraphKey(Phase.PREFILL, 1, 16 if length <= 16 else 32)
    assert graphs.key_for(step) == key
    slots, _, _ = _own(llm, request)
    scratch = llm.cache.ledger.seqs[SCRATCH_SEQ_ID]
    for name, t in _pools(llm).items():  # noise everywhere but the fresh sequence's own (zero) states
        if not name.startswith("pages"):
            others = [i for i in range(t.shape[0]) if i not in slots]
            t[others] = torch.randn_like(t[others].float()).to(t.dtype)
        else:
            t.normal_()
    before = {name: t.clone() for name, t in _pools(llm).items()}
    logits = llm.runner.run(step).logits
    assert key in graphs.graphs, graphs.uncapturable
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    _, pages, latent_slots = _own(llm, request)  # after the step, which maps the pages
    for name, t in _flat(llm).items():
        got = t[list(slots) if not name.startswith("pages") else latent_slots]
        torch.testing.assert_close(got, want[name], rtol=1e-4, atol=1e-4, msg=name)
    for name, t in _pools(llm).items():
        owned = (pages | set(scratch.pages)) if name.startswith("pages") else (slots | {scratch.slot})
        others = [i for i in range(t.shape[0]) if i not in owned]
        assert torch.equal(t[others], before[name][others]), f"{name}: the padded prefill wrote outside its rows"


def _flat(llm) -> dict[str, torch.Tensor]:
    """The pools with the pages flattened to latent slots: [slots or pages * page_size, ...]."""
    return {name: t.flatten(0, 1) if name.startswith("pages") else t for name, t in _pools(llm).items()}


def test_graph_prefill_generation_equals_eager():
    """Greedy generation of prompts of every length around the buckets (graphed prefills, then graphed decodes)
    equals eager generation."""
    model = _model("cpu")
    prompts = [_prompt(n) for n in (3, 15, 16, 17, 31, 32, 33)]
    eager = [o.token_ids for o in _llm(model, False).generate(prompts, GREEDY)]
    llm = _llm(model, True)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == eager  # one prompt a step
    prefills = {k for k in llm.runner.graphs.graphs if k.phase is Phase.PREFILL}
    assert prefills == {GraphKey(Phase.PREFILL, 1, n) for n in (16, 32, 64)}


def test_prefill_padding_fits_a_one_sequence_runner():
    """An engine of max_num_seqs = 1 (batch-1 serving) stages a padded prefill too: its buffers hold the padding's
    second sequence, while its graphs' batch buckets stay those of one sequence."""
    llm = _llm(_model("cpu"), False, max_num_seqs=1)
    runner = llm.runner
    assert runner.max_num_seqs == 1 and runner.buffers.max_seqs == 2
    runner.prepare(ScheduledStep([], [], []), PrefillPadding(16, page=0, slot=0))
    graphs = StepGraphs(runner, use_graphs=False)
    assert graphs.max_seqs == 1 and graphs.buckets == (1,) and graphs.prefill_buckets[:2] == (16, 32)


@pytest.mark.parametrize("buckets", [(0, 16), (16, -32), (16.0,)], ids=["zero", "negative", "float"])
def test_prefill_buckets_must_be_token_counts(buckets):
    llm = _llm(_model("cpu"), False)
    with pytest.raises(ValueError, match="prefill_buckets must be ints >= 1"):
        StepGraphs(llm.runner, use_graphs=False, prefill_buckets=buckets)


def test_prefill_graph_keys():
    """Only one request's whole fresh prompt, wanting its last row's logits only, within the largest bucket."""
    llm = _llm(_model("cpu"), True, max_model_len=1024, max_num_batched_tokens=1024)
    graphs, prefill = llm.runner.graphs, Phase.PREFILL
    assert graphs.prefill_buckets == default_prefill_buckets(1024) == (16, 32, 64, 128, 256, 512)

    def step(*prompts, **params):
        requests = [llm._make_request(p, SamplingParams(max_tokens=2, **params)) for p in prompts]
        return ScheduledStep(requests, [prefill] * len(requests), [list(p) for p in prompts])

    assert graphs.key_for(step(_prompt(1))) == GraphKey(prefill, 1, 16)
    assert graphs.key_for(step(_prompt(100))) == GraphKey(prefill, 1, 128)
    assert graphs.key_for(step(_prompt(512))) == GraphKey(prefill, 1, 512)
    assert graphs.key_for(step(_prompt(513))) is None  # beyond the largest bucket
    assert graphs.key_for(step(_prompt(5), _prompt(7))) is None  # two prompts
    assert graphs.key_for(step(_prompt(5), prompt_logprobs=1)) is None  # every row's logits
    chunk = step(_prompt(40))
    chunk.token_ids[0] = chunk.token_ids[0][:20]  # the prompt's first chunk: its logits are not wanted
    chunk.num_tokens[0] = 20
    assert graphs.key_for(chunk) is None
    resumed = step(_prompt(40))
    resumed.requests[0].num_computed = 8  # a chunk after a cached context
    assert graphs.key_for(resumed) is None


def test_tail_padding_needs_one_fresh_prefill_sequence():
    padding = TailPadding(torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([1, 2]))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    ForwardBatch([8], [0], cu, torch.arange(8), [Phase.PREFILL], tail_padding=padding)
    assert padding.padding_rows(8).tolist() == [False] * 3 + [True] * 5
    cases = [  # (seq_lens, context_lens, phases)
        ([4, 4], [0, 0], [Phase.PREFILL] * 2),
        ([8], [2], [Phase.PREFILL]),
        ([8], [0], [Phase.VERIFY]),
    ]
    for seq_lens, contexts, phases in cases:
        cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
        with pytest.raises(ValueError, match="tail_padding applies to one prefill sequence"):
            ForwardBatch(seq_lens, contexts, cu, torch.arange(8), phases, tail_padding=padding)
