"""ModelRunner: logits at the requested rows equal the full forward's, for verify groups in a mixed step too."""

import torch

from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.engine.runner import Padding
from kimi_helix.engine.scheduler import Request, ScheduledStep
from kimi_helix.modeling.batch import Phase

from .test_llm import make_model, prompts


def admitted(llm, i, prompt, max_tokens=16, **params):
    r = Request(i, None, prompt, SamplingParams(max_tokens=max_tokens, **params), None)
    llm.cache.ledger.admit(i, r.reserve_tokens)
    return r


def run(llm, entries):
    """Run one step of (request, phase, token ids) entries and advance the requests' cached lengths."""
    step = ScheduledStep([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])
    out = llm.runner.run(step)
    for r, tokens in zip(step.requests, step.token_ids):
        r.num_computed += len(tokens)
    return out


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_verify_logits_equal_the_full_forward_at_every_position_in_a_mixed_step():
    model = make_model()
    llm = LLM(model, page_size=8, max_num_batched_tokens=64)
    a, b, c, extra = prompts([21, 13, 30, 6], seed=11)
    ra, rb = admitted(llm, 0, a), admitted(llm, 1, b)
    rc = admitted(llm, 2, c, prompt_logprobs=0)
    first = run(llm, [(ra, Phase.PREFILL, a), (rb, Phase.PREFILL, b)])
    assert [s.stop - s.start for s in first.rows] == [1, 1]  # last prompt token of each final chunk
    torch.testing.assert_close(first.logits[first.rows[0]], full_logits(model, a)[-1:], rtol=1e-5, atol=1e-5)
    # A verify group of 1 + 5 tokens, a decode and an intermediate prefill chunk (with prompt_logprobs) together.
    out = run(llm, [(ra, Phase.VERIFY, extra), (rb, Phase.DECODE, extra[:1]), (rc, Phase.PREFILL, c[:17])])
    assert [s.stop - s.start for s in out.rows] == [6, 1, 17]
    checks = [(a + extra, 21, 6), (b + extra[:1], 13, 1), (c[:17], 0, 17)]
    for rows, (ids, start, n) in zip(out.rows, checks):
        torch.testing.assert_close(out.logits[rows], full_logits(model, ids)[start : start + n], rtol=1e-5, atol=1e-5)


def test_a_verify_group_of_one_token_records_its_state_and_input():
    """A verify group without drafts takes the varlen conv (which writes the rollback records) where a decode takes
    the one-token update: the same logits and states, and its record holds the conv state before it and its input."""
    llm = LLM(make_model(), page_size=8)
    (a,) = prompts([11], seed=16)
    ra, rb = admitted(llm, 0, a), admitted(llm, 1, a)
    run(llm, [(ra, Phase.PREFILL, a), (rb, Phase.PREFILL, a)])
    slot_a, slot_b = llm.cache.ledger.seqs[0].slot, llm.cache.ledger.seqs[1].slot
    before = {layer: pool[slot_a].clone() for layer, pool in llm.cache.conv.items()}
    out = run(llm, [(ra, Phase.VERIFY, [7]), (rb, Phase.DECODE, [7])])
    torch.testing.assert_close(out.logits[out.rows[0]], out.logits[out.rows[1]], rtol=1e-5, atol=1e-5)
    assert before and set(llm.cache.verify_records) == set(before)
    for layer, conv in llm.cache.conv.items():
        record = llm.cache.verify_records[layer][0]
        assert record.context_len == len(a) and torch.equal(record.conv_before, before[layer])
        assert torch.equal(torch.cat([record.conv_before, record.inputs])[-conv.shape[1] :], conv[slot_a])
        torch.testing.assert_close(conv[slot_a], conv[slot_b], rtol=1e-5, atol=1e-5)  # deeper layers' inputs round


def test_intermediate_prefill_chunks_return_no_rows():
    llm = LLM(make_model(), page_size=8)
    (p,) = prompts([20], seed=12)
    r = admitted(llm, 0, p)
    out = run(llm, [(r, Phase.PREFILL, p[:12])])
    assert out.rows == [slice(0, 0)] and out.logits.shape[0] == 0
    out = run(llm, [(r, Phase.PREFILL, p[12:])])
    assert out.rows == [slice(0, 1)]


def test_steps_of_one_shape_read_the_same_device_buffers():
    """What CUDA graph replay needs: every input the forward reads lives at a fixed address."""
    llm = LLM(make_model(), page_size=8)
    reqs = [admitted(llm, i, p) for i, p in enumerate(prompts([9, 14], seed=13))]
    run(llm, [(r, Phase.PREFILL, r.prompt_ids) for r in reqs])

    def addresses():
        step = ScheduledStep(reqs, [Phase.DECODE] * 2, [[5], [6]])
        inputs, _ = llm.runner.prepare(step)
        v, batch = inputs.view, inputs.batch
        tensors = (inputs.input_ids, batch.positions, batch.cu_seqlens, v.block_table, v.cache_seqlens)
        tensors += (v.slot_mapping, v.state_indices, inputs.logits_index)
        for r in reqs:
            r.num_computed += 1
        return [t.data_ptr() for t in tensors], inputs.view.cache_seqlens.tolist()

    (first, lens1), (second, lens2) = addresses(), addresses()
    assert first == second and lens2 == [n + 1 for n in lens1]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_step_is_staged_on_the_host_and_goes_over_in_one_copy():
    """A mixed step's inputs are views of the runner's one device buffer, filled by one upload, with the values the
    ledger implies (positions, token slots, lengths, block table, state slots, logit rows)."""
    llm = LLM(make_model(), page_size=8, max_num_batched_tokens=64)
    a, b, c = prompts([21, 13, 30], seed=14)
    ra, rb, rc = admitted(llm, 0, a), admitted(llm, 1, b), admitted(llm, 2, c)
    run(llm, [(ra, Phase.PREFILL, a), (rb, Phase.PREFILL, b)])
    buffers, uploads = llm.runner.buffers, []
    upload = buffers.upload
    buffers.upload = lambda *shape: (uploads.append(shape), upload(*shape))
    step = ScheduledStep([ra, rb, rc], [Phase.VERIFY, Phase.DECODE, Phase.PREFILL], [[5, 6, 7], [8], c[:10]])
    inputs, rows = llm.runner.prepare(step)
    assert uploads == [(14, 3, 4)]  # 14 tokens, 3 sequences, 4 logit rows (3 verify, 1 decode, none mid-prompt)
    v, batch = inputs.view, inputs.batch
    tensors = (inputs.input_ids, batch.positions, batch.cu_seqlens, v.block_table, v.cache_seqlens, v.slot_mapping)
    assert {_storage(t) for t in (*tensors, v.state_indices, inputs.logits_index)} == {_storage(buffers.device_bytes)}
    ledger, ps = llm.cache.ledger, 8
    positions = [*range(21, 24), 13, *range(0, 10)]
    owners = [0, 0, 0, 1] + [2] * 10
    assert inputs.input_ids.tolist() == [5, 6, 7, 8] + c[:10]
    assert batch.positions.tolist() == positions
    assert v.slot_mapping.tolist() == [ledger.seqs[s].pages[p // ps] * ps + p % ps for s, p in zip(owners, positions)]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 14] and v.cache_seqlens.tolist() == [24, 14, 10]
    assert v.state_indices.tolist() == [ledger.seqs[s].slot for s in range(3)]
    for s, row in enumerate(v.block_table.tolist()):
        pages = ledger.seqs[s].pages
        assert row == pages + [0] * (len(row) - len(pages))
    assert inputs.logits_index.tolist() == [0, 1, 2, 3] and rows == [slice(0, 3), slice(3, 4), slice(4, 4)]


def test_padding_rows_are_staged_with_the_live_ones():
    """A graphed step's padding rows (`Padding`) address only the padding page and slot, in the same upload."""
    llm = LLM(make_model(), page_size=8, max_num_seqs=6)
    reqs = [admitted(llm, i, p) for i, p in enumerate(prompts([9, 14, 5], seed=15))]
    run(llm, [(r, Phase.PREFILL, r.prompt_ids) for r in reqs])
    page, slot = llm.cache.ledger.free_pages[-1], llm.cache.ledger.free_slots[-1]
    step = ScheduledStep(reqs, [Phase.VERIFY] * 3, [[1, 2], [3, 4], [5, 6]])
    llm.runner.prepare(step, Padding(batch=4, tokens_per_seq=2, page=page, slot=slot))
    full = llm.runner.buffers.fields(8, 4, 8)
    assert full.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert full.positions.tolist()[6:] == [0, 1] and full.slot_mapping.tolist()[6:] == [page * 8, page * 8 + 1]
    assert full.cu_seqlens.tolist() == [0, 2, 4, 6, 8] and full.cache_seqlens.tolist() == [11, 16, 7, 2]
    assert full.state_indices.tolist()[3] == slot and set(full.block_table[3].tolist()) == {page}
