"""CUDA-graph steps (`engine.cuda_graph`) give the tokens and logits of eager steps, for decode and verify; padded
rows leave every live sequence's state alone; the kernels per replayed decode step are recorded.

On the CPU the same checks run with `StepGraphs(use_graphs=False)`: every step padded to its bucket and run from the
graphs' static buffers, which is exactly what a graph replays, without the capture. On the GPU (`-m gpu`) with real
graphs.
"""

from __future__ import annotations

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.engine.async_scheduling import PLACEHOLDER
from kimi_helix.engine.cuda_graph import SCRATCH_SEQ_ID, GraphKey, StepGraphs, default_buckets
from kimi_helix.engine.scheduler import ScheduledStep
from kimi_helix.kernels.device import interpreting
from kimi_helix.modeling.batch import Phase

from ..modeling.conftest import randomize_router_bias, tiny_kwargs

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
DEVICES = pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["static-buffers-cpu", "graphs-gpu"]
)


def test_default_buckets_cover_every_batch_size():
    for max_seqs in (1, 3, 64, 100, 256):
        buckets = default_buckets(max_seqs)
        assert buckets == tuple(sorted(set(buckets))) and buckets[-1] == max_seqs and buckets[0] == 1


def _model(device: str) -> KimiK3ForCausalLM:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    # Triton tiles need power-of-two widths (latent 64 + 16): on the GPU every op of the step has a capture-safe kernel.
    kwargs = tiny_kwargs(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(model)
    return model.to(device)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(1, 30, (n,), generator=g).tolist()
    return [torch.randint(3, 128, (m,), generator=g).tolist() for m in lens]


def _llm(model, graphs: bool, kv_cache_dtype: str = "auto", **engine) -> LLM:
    """An engine with graphs (real ones on CUDA, static-buffer steps on the CPU) or without; its verify graphs
    take the hand-set drafts of these tests (up to 8, `max_draft_tokens`). Synchronous unless `engine` says
    otherwise: the tests schedule and run steps by hand, and an asynchronous step leaves its tokens on the device
    (`test_async_scheduling.py` covers graphs with overlapped steps)."""
    engine = {"async_scheduling": False, "max_num_seqs": 8, "max_model_len": 64, **engine}
    on_cuda = next(model.parameters()).is_cuda
    llm = LLM(
        model,
        enforce_eager=not (graphs and on_cuda),
        page_size=16,
        kv_cache_dtype=kv_cache_dtype,
        max_draft_tokens=8,
        **engine,
    )
    if graphs and not on_cuda:
        llm.runner.graphs = StepGraphs(llm.runner, use_graphs=False)
    return llm


@DEVICES
@pytest.mark.parametrize(
    "num_prompts,kv_cache_dtype",
    [(1, "auto"), (3, "auto"), (8, "auto"), (3, "fp8_e4m3")],
    ids=["b1", "b3", "b8", "b3-fp8"],
)
def test_graph_decode_gives_the_eager_tokens(device, num_prompts, kv_cache_dtype):
    """Greedy generation with graphs (batch sizes padded to a bucket, and one that fills it) equals eager."""
    model = _model(device)
    prompts = _prompts(num_prompts)
    eager = [o.token_ids for o in _llm(model, False, kv_cache_dtype).generate(prompts, GREEDY)]
    llm = _llm(model, True, kv_cache_dtype, async_scheduling=None)  # the engine's default: overlapped on CUDA
    graphed = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert graphed == eager
    assert any(k.phase is Phase.DECODE for k in llm.runner.graphs.graphs), llm.runner.graphs.uncapturable


def _prefilled(llm: LLM, prompts: list[list[int]]):
    """Requests whose prompts are prefilled and first tokens sampled (eager steps): ready to decode or verify.

    The tests then drive `runner.run` by hand, which patches no input row: no token may still be on the device."""
    requests = [llm._make_request(p, GREEDY) for p in prompts]
    for r in requests:
        llm.scheduler.add(r)
    while any(r.prefilling or not r.output_ids for r in requests):
        llm.step()
    assert all(PLACEHOLDER not in r.output_ids for r in requests)
    return requests


@DEVICES
@pytest.mark.parametrize("k", [1, 4], ids=lambda k: f"k{k}")
def test_graph_verify_gives_the_eager_logits(device, k):
    """A verify step of 1 + k tokens for 3 sequences (padded to bucket 4): graph logits equal eager ones."""
    model = _model(device)
    prompts = _prompts(3)
    outs = []
    for graphs in (False, True):
        llm = _llm(model, graphs)
        for i, r in enumerate(_prefilled(llm, prompts)):
            r.draft_token_ids = [(7 * i + j) % 100 + 3 for j in range(k)]
        step = llm.scheduler.schedule()
        assert step.phases == [Phase.VERIFY] * 3
        out = llm.runner.run(step)
        outs.append((out.logits.clone(), out.rows))
        if graphs:
            assert GraphKey(Phase.VERIFY, 4, 1 + k) in llm.runner.graphs.graphs, llm.runner.graphs.uncapturable
    (eager_logits, eager_rows), (graph_logits, graph_rows) = outs
    assert eager_rows == graph_rows and graph_logits.shape == (3 * (1 + k), model.config.vocab_size)
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))


@DEVICES
def test_padded_rows_touch_only_the_scratch_sequence(device):
    """3 live sequences run as bucket 4: no state slot or page but theirs and the scratch sequence's changes, even
    when the buffers' padding rows still hold a previous, larger step's live addresses."""
    model = _model(device)
    llm = _llm(model, graphs=True)
    requests = _prefilled(llm, _prompts(4))
    llm.step()  # a decode step of all 4 fills every row of bucket 4 with live addresses
    llm.scheduler.finish(requests[3], "stop")
    ledger = llm.cache.ledger
    kept = [r.request_id for r in requests[:3]] + [SCRATCH_SEQ_ID]
    slots = {ledger.seqs[s].slot for s in kept}
    for t in _pools(llm).values():
        t.normal_()  # every slot and page holds a value padding could overwrite
    before = {name: t.clone() for name, t in _pools(llm).items()}
    step = llm.scheduler.schedule()
    assert len(step.requests) == 3 and llm.runner.graphs.key_for(step) == GraphKey(Phase.DECODE, 4, 1)
    llm.runner.run(step)
    pages = {p for s in kept for p in ledger.seqs[s].pages}  # after the step: it may map a page at a page edge
    for name, t in _pools(llm).items():
        owned = pages if name.startswith("pages") else slots
        others = [i for i in range(t.shape[0]) if i not in owned]
        assert torch.equal(t[others], before[name][others]), f"{name}: a padded row wrote outside the scratch"


def _pools(llm: LLM) -> dict[str, torch.Tensor]:
    pools = {f"pages:{i}": t for i, t in llm.cache.pages.items()}
    pools.update({f"conv:{i}": t for i, t in llm.cache.conv.items()})
    pools.update({f"recurrent:{i}": t for i, t in llm.cache.recurrent.items()})
    return pools


def test_mixed_unequal_and_prefill_steps_have_no_graph():
    model = _model("cpu")
    llm = _llm(model, graphs=True)
    a, b = _prefilled(llm, _prompts(2))
    key_for = llm.runner.graphs.key_for
    decode, verify, prefill = Phase.DECODE, Phase.VERIFY, Phase.PREFILL
    assert key_for(ScheduledStep([a, b], [decode, decode], [[1], [2]])) == GraphKey(decode, 2, 1)
    assert key_for(ScheduledStep([a, b], [verify, verify], [[1, 2], [3, 4]])) == GraphKey(verify, 2, 2)
    assert key_for(ScheduledStep([a, b], [verify, decode], [[1, 2], [3]])) is None  # mixed phases
    assert key_for(ScheduledStep([a, b], [verify, verify], [[1, 2], [3, 4, 5]])) is None  # unequal groups
    assert key_for(ScheduledStep([a, b], [verify, verify], [[1] * 10, [2] * 10])) is None  # k = 9 > 8
    assert key_for(ScheduledStep([a], [prefill], [[1, 2, 3]])) is None
    assert key_for(ScheduledStep([a] * 9, [decode] * 9, [[1]] * 9)) is None  # beyond the largest bucket


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_kernels_per_replayed_decode_step_are_recorded(batch, record_property):
    """Counts the CUDA kernels of one replayed decode step (recorded, not asserted against a budget)."""
    from torch.profiler import ProfilerActivity, profile

    model = _model("cuda")
    llm = _llm(model, graphs=True)
    _prefilled(llm, _prompts(batch))
    llm.step()  # captures the decode graph of this bucket
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.step()
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = sum("memcpy" not in n and "memset" not in n for n in names)
    layers = model.config.num_hidden_layers
    print(f"decode step, batch {batch}: {kernels} kernels, {kernels / layers:.1f} a layer")
    record_property("kernels_per_step", kernels)
    assert kernels > 0, "the profiler saw no kernel of the replayed graph"


def _verify_then_rollback(llm: LLM, prompts: list[list[int]], k: int, keep: list[int]):
    """One verify step of 1 + k tokens per sequence, then every sequence cut back to its first keep[i] tokens of
    the group in one `rollback_many`, as `LLM.step` does: the cache's verify records (cloned) and the KDA states
    after the rollback."""
    requests = _prefilled(llm, prompts)
    for i, r in enumerate(requests):
        r.draft_token_ids = [(5 * i + j) % 100 + 3 for j in range(k)]
    step = llm.scheduler.schedule()
    assert step.phases == [Phase.VERIFY] * len(prompts)
    llm.runner.run(step)
    records = {
        (layer, s): [rec.context_len, rec.conv_before.clone(), rec.inputs.clone(), rec.states.clone()]
        for layer, recs in llm.cache.verify_records.items()
        for s, rec in recs.items()
    }
    llm.cache.rollback_many([(r.request_id, r.num_computed + n) for r, n in zip(requests, keep)])
    slots = [llm.cache.ledger.seqs[r.request_id].slot for r in requests]
    states = {i: (llm.cache.conv[i][slots].clone(), llm.cache.recurrent[i][slots].clone()) for i in llm.cache.conv}
    return records, states


@DEVICES
def test_graph_verify_records_and_rollback_equal_eager(device):
    """Verify steps replayed from a graph (3 sequences in bucket 4) leave the records `PagedCache.rollback` reads,
    for the step's own sequences, equal to an eager step's; so do the states after cutting each group back."""
    model = _model(device)
    prompts, k, keep = _prompts(3), 4, [1, 3, 5]
    eager_records, eager_states = _verify_then_rollback(_llm(model, False), prompts, k, keep)
    llm = _llm(model, True)
    records, states = _verify_then_rollback(llm, prompts, k, keep)
    assert GraphKey(Phase.VERIFY, 4, 1 + k) in llm.runner.graphs.graphs, llm.runner.graphs.uncapturable
    scratch = next(iter(llm.cache.verify_scratch.values()))
    assert scratch.states.shape[0] >= 4 * (1 + k)
    # the graphed step's records are views of the static scratch (the rollback cuts all layers at once from it)
    rows = {rec.scratch_at for recs in llm.cache.verify_records.values() for rec in recs.values()}
    assert rows == {(0, 0), (1 + k, 1), (2 * (1 + k), 2)}
    assert sorted(records) == sorted(eager_records) and {s for _, s in records} == {0, 1, 2}
    for key, (ctx, *tensors) in records.items():
        assert ctx == eager_records[key][0]
        for got, want in zip(tensors, eager_records[key][1:]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for i, (conv, recurrent) in states.items():
        torch.testing.assert_close(conv, eager_states[i][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(recurrent, eager_states[i][1], rtol=1e-4, atol=1e-4)


def test_rollback_many_checks_every_cut_before_applying_any():
    """A cut outside its group raises and leaves the other sequences' states and lengths as they were; one at a
    time, the same cuts give what `rollback_many` gives."""
    model, prompts, k = _model("cpu"), _prompts(3), 4
    _, together = _verify_then_rollback(_llm(model, True), prompts, k, [1, 3, 5])
    llm = _llm(model, True)
    requests = _prefilled(llm, prompts)
    for i, r in enumerate(requests):
        r.draft_token_ids = [(5 * i + j) % 100 + 3 for j in range(k)]
    llm.runner.run(llm.scheduler.schedule())
    slots = [llm.cache.ledger.seqs[r.request_id].slot for r in requests]
    before = {i: (conv[slots].clone(), llm.cache.recurrent[i][slots].clone()) for i, conv in llm.cache.conv.items()}
    lengths = [llm.cache.ledger.seqs[r.request_id].length for r in requests]
    bad = [(requests[0].request_id, lengths[0] - 1), (requests[1].request_id, lengths[1] - 1 - k)]
    with pytest.raises(ValueError, match="only be cut back inside the last step's verify group"):
        llm.cache.rollback_many(bad)
    assert [llm.cache.ledger.seqs[r.request_id].length for r in requests] == lengths
    for i, (conv, recurrent) in before.items():
        assert torch.equal(llm.cache.conv[i][slots], conv) and torch.equal(llm.cache.recurrent[i][slots], recurrent)
    for r, n in zip(requests, [1, 3, 5]):
        llm.cache.rollback(r.request_id, r.num_computed + n)
    for i, (conv, recurrent) in together.items():
        assert torch.equal(llm.cache.conv[i][slots], conv) and torch.equal(llm.cache.recurrent[i][slots], recurrent)


@DEVICES
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_restore_verified_on_the_device_equals_rollback(device, backend):
    """`PagedCache.restore_verified` (the accepted counts on the device, every layer and group at once) leaves the
    KDA states `rollback` leaves from host lengths, for every cut from the anchor alone to the whole group, with
    either kernel."""
    model = _model(device)
    prompts, k = _prompts(3), 4
    keep = [1, 3, 5]
    _, want = _verify_then_rollback(_llm(model, True), prompts, k, keep)
    llm = _llm(model, True)
    device = llm.device  # the engine's (a CPU model goes to CUDA where there is one)
    if backend == "triton" and device.type == "cpu" and not interpreting():
        pytest.skip("Triton runs on the CPU only under TRITON_INTERPRET=1")
    requests = _prefilled(llm, prompts)
    for i, r in enumerate(requests):
        r.draft_token_ids = [(5 * i + j) % 100 + 3 for j in range(k)]
    llm.runner.run(llm.scheduler.schedule())
    slots = [llm.cache.ledger.seqs[r.request_id].slot for r in requests]
    accepted = torch.tensor(keep, device=device) - 1
    llm.cache.restore_verified(torch.tensor(slots, device=device), accepted, 1 + k, backend=backend)
    for i, (conv, recurrent) in want.items():
        torch.testing.assert_close(llm.cache.conv[i][slots], conv, rtol=0, atol=0)
        torch.testing.assert_close(llm.cache.recurrent[i][slots], recurrent, rtol=0, atol=0)


def test_verify_steps_beyond_the_scratch_run_eagerly():
    """A verify bucket whose tokens would not fit `verify_tokens` gets no graph; decodes still do."""
    llm = LLM(_model("cpu"), max_num_seqs=8, max_model_len=64, page_size=16)
    graphs = StepGraphs(llm.runner, max_draft_tokens=3, use_graphs=False, verify_tokens=2 * 4 + 3)
    assert graphs.max_verify_seqs == 2
    a, b, c = _prefilled(llm, _prompts(3))
    verify = Phase.VERIFY
    assert graphs.key_for(ScheduledStep([a, b], [verify] * 2, [[1, 2]] * 2)) == GraphKey(verify, 2, 2)
    assert graphs.key_for(ScheduledStep([a, b, c], [verify] * 3, [[1, 2]] * 3)) is None
    assert graphs.key_for(ScheduledStep([a, b, c], [Phase.DECODE] * 3, [[1]] * 3)) == GraphKey(Phase.DECODE, 4, 1)


@DEVICES
@pytest.mark.parametrize("k", [2, 5], ids=lambda k: f"k{k}")
def test_speculative_greedy_with_graphs_equals_eager_and_plain_greedy(device, k):
    """Speculative greedy decoding with verify steps replayed from graphs (partial acceptance forced at every
    position, so the KDA rollback reads the scratch a replay wrote) equals the eager run and plain greedy."""
    from ..speculative.conftest import OracleProposer

    model = _model(device)
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in _llm(model, False).generate(prompts, params)]
    oracle = {i: {"prompt": p, "out": o} for i, (p, o) in enumerate(zip(prompts, plain))}
    outs = []
    for graphs in (False, True):
        llm = LLM(
            model,
            max_num_seqs=8,
            max_model_len=64,
            page_size=16,
            enforce_eager=not graphs,
            speculative_config={"method": "custom", "num_speculative_tokens": k},
            proposer=OracleProposer(oracle, vocab=model.config.vocab_size),
        )
        if graphs and device == "cpu":
            llm.runner.graphs = StepGraphs(llm.runner, use_graphs=False)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert 0 < llm.speculative.metrics.acceptance_by_position[0] < 1  # rollbacks happened
    graphs = llm.runner.graphs
    assert any(key.phase is Phase.VERIFY for key in graphs.graphs), graphs.uncapturable
    assert outs[0] == plain and outs[1] == plain


def test_steps_run_eagerly_while_a_layer_has_a_forward_hook():
    """A replay runs no Python, so a hook (DSpark's feature capture) would miss the step: such steps run eagerly."""
    model = _model("cpu")
    llm = _llm(model, graphs=True)
    _prefilled(llm, _prompts(3))
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda _m, _i, out: seen.append(out.shape[0]))
    try:
        step = llm.scheduler.schedule()
        assert llm.runner.graphs.key_for(step) is not None and llm.runner.graphs.run(step) is None
        llm.step()
        assert seen == [3]  # the eager step's three tokens, not bucket 4's padded shape
    finally:
        handle.remove()
    step = llm.scheduler.schedule()
    assert llm.runner.graphs.run(step) is not None
