"""`LLM(speculative_config=...)`: greedy speculative output equals plain greedy token for token on a random tiny
model with KDA layers, with partial acceptance forced at every position, verify groups straddling pages, and
batches mixing speculative and plain requests; the validator runs before any weights load."""

from __future__ import annotations

import json

import pytest
import torch

from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.modeling import KimiK3ForCausalLM
from kimi_helix.presets import get_preset
from kimi_helix.speculative import UnsupportedConfigError
from kimi_helix.speculative.dspark import DSparkDrafter

from .conftest import OracleProposer, tiny_drafter_config

GREEDY = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
PAGE = 4  # verify groups of up to 6 tokens always straddle 4-token pages


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = KimiK3ForCausalLM(get_preset("tiny")).eval()
    assert "linear_attention" in m.config.layer_types
    return m


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 3, 8)]


@pytest.fixture(scope="module")
def plain(model, prompts):
    return [o.token_ids for o in LLM(model, page_size=PAGE).generate(prompts, GREEDY)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_forced_partial_acceptance_equals_plain_greedy(model, prompts, plain, k):
    oracle = {i: {"prompt": p, "out": o} for i, (p, o) in enumerate(zip(prompts, plain))}
    proposer = OracleProposer(oracle, plain_ids={2})
    llm = LLM(
        model,
        page_size=PAGE,
        speculative_config={"method": "custom", "num_speculative_tokens": k},
        proposer=proposer,
    )
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    m = llm.speculative.metrics
    assert m.rounds > 0 and len(m.acceptance_by_position) == k
    # every position was both accepted and rejected at least once
    assert all(0 < a < 1 for a in m.acceptance_by_position)


def _ledger_trace(llm, prompts):
    """Step `prompts` through `llm`; after each step, per running request (whether its cached length equals the
    tokens it kept, its cached length, its pages), and the free-page count."""
    requests = [llm._make_request(p, GREEDY) for p in prompts]
    for r in requests:
        llm.scheduler.add(r)
    ledger, trace = llm.cache.ledger, []
    while llm.scheduler.has_work:
        llm.step()
        seqs = {r.request_id: ledger.seqs[r.request_id] for r in llm.scheduler.running}
        rows = {i: (b.length == requests[i].num_computed, b.length, tuple(b.pages)) for i, b in seqs.items()}
        trace.append((rows, len(ledger.free_pages)))
    return requests, trace


def test_rollback_leaves_the_ledger_of_a_plain_run(model, prompts, plain):
    """After every step, forced partial acceptances (verify groups straddling 4-token pages) included, each
    sequence's cached MLA length is the kept tokens and it holds exactly the pages covering them, as in a plain
    run (a rollback returns the pages past the accepted length); no page is shared or leaked, and at the end every
    page is free."""
    oracle = {i: {"prompt": p, "out": o} for i, (p, o) in enumerate(zip(prompts, plain))}
    spec = {"method": "custom", "num_speculative_tokens": 3}
    runs = {
        "plain": LLM(model, page_size=PAGE),
        "spec": LLM(model, page_size=PAGE, speculative_config=spec, proposer=OracleProposer(oracle)),
    }
    for llm in runs.values():
        requests, trace = _ledger_trace(llm, prompts)
        assert [r.output_ids for r in requests] == plain
        ledger = llm.cache.ledger
        for rows, num_free in trace:
            assert all(same and len(pages) == -(-length // PAGE) for same, length, pages in rows.values())
            mapped = [p for _, _, pages in rows.values() for p in pages]
            assert len(set(mapped)) == len(mapped) and num_free == ledger.num_pages - len(mapped)
        assert len(ledger.free_pages) == ledger.num_pages and len(ledger.free_slots) == ledger.num_slots
    assert runs["spec"].speculative.metrics.rounds > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_equals_plain_greedy(model, prompts, plain, k):
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(model, page_size=PAGE, speculative_config=spec)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    assert llm.speculative.metrics.rounds > 0


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("drafter")
    DSparkDrafter(tiny_drafter_config(block_size=5)).save_pretrained(path)
    return path


@pytest.mark.parametrize("k", [1, 3, 5])
def test_dspark_greedy_equals_plain_greedy(model, prompts, plain, drafter_dir, k):
    spec = {"method": "dspark", "model": str(drafter_dir), "num_speculative_tokens": k}
    llm = LLM(model, page_size=PAGE, speculative_config=spec)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    m = llm.speculative.metrics
    assert m.rounds > 0 and m.tau >= 1.0


def test_dspark_sampling_is_seeded(model, prompts, drafter_dir):
    spec = {"method": "dspark", "model": str(drafter_dir), "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    runs = [
        [o.token_ids for o in LLM(model, page_size=PAGE, speculative_config=spec).generate(prompts, params)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and all(len(t) == 10 for t in runs[0])


def test_validator_runs_before_any_weights_load(tmp_path, drafter_dir):
    get_preset("tiny").save_pretrained(tmp_path)  # config.json only: loading weights would fail differently
    assert not any(p.suffix == ".safetensors" for p in tmp_path.iterdir())
    spec = {"method": "dspark", "model": str(drafter_dir), "num_speculative_tokens": 9}
    with pytest.raises(UnsupportedConfigError, match="num_speculative_tokens"):
        LLM(tmp_path, device="cpu", speculative_config=spec)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert cfg["model_type"] == "dspark"
    with pytest.raises(UnsupportedConfigError, match="proposer="):
        LLM(tmp_path, device="cpu", speculative_config={"method": "custom", "num_speculative_tokens": 2})


def test_dspark_without_a_model_takes_the_targets_default_drafter(tmp_path, drafter_dir, monkeypatch):
    """`assets.default_drafter_dir` names the drafter shipped for a target folder (the demo model's); without
    one, DSpark needs a `model`."""
    from kimi_helix import assets

    get_preset("tiny").save_pretrained(tmp_path)
    asked = []
    monkeypatch.setattr(assets, "default_drafter_dir", lambda folder: asked.append(folder), raising=False)
    with pytest.raises(UnsupportedConfigError, match="dspark needs a drafter"):
        LLM(tmp_path, device="cpu", speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    assert asked == [tmp_path]
    monkeypatch.setattr(assets, "default_drafter_dir", lambda folder: drafter_dir, raising=False)
    with pytest.raises(UnsupportedConfigError, match="num_speculative_tokens") as err:  # its block size is 5
        LLM(tmp_path, device="cpu", speculative_config={"method": "dspark", "num_speculative_tokens": 6})
    assert [r.field for r in err.value.reasons] == ["num_speculative_tokens"]


def test_kda_state_cannot_be_cut_outside_the_last_verify_group(model):
    llm = LLM(model, page_size=PAGE)
    request = llm._make_request(list(range(1, 8)), SamplingParams(max_tokens=5, temperature=0.0))
    llm.scheduler.add(request)
    llm.step()  # the prefill: no verify group to cut back into
    with pytest.raises(ValueError, match="inside the last step's verify group"):
        llm.cache.rollback(request.request_id, 3)


def test_confidence_scheduling_keeps_greedy_output_and_caches_its_table(model, prompts, plain, drafter_dir, tmp_path):
    table = tmp_path / "sps.json"
    spec = {
        "method": "dspark",
        "model": str(drafter_dir),
        "num_speculative_tokens": 5,
        "confidence_scheduling": True,
        "step_rate_table": str(table),
    }
    llm = LLM(model, page_size=PAGE, max_num_batched_tokens=8, speculative_config=spec)
    saved = json.loads(table.read_text())
    assert saved["batch_tokens"][0] == 1 and saved["batch_tokens"][-1] == 8 and all(s > 0 for s in saved["steps_per_s"])
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    assert llm.speculative.metrics.rounds > 0
    table.write_text(json.dumps({**saved, "steps_per_s": [1.0] * len(saved["batch_tokens"])}))
    again = LLM(model, page_size=PAGE, max_num_batched_tokens=8, speculative_config=spec)
    assert again.speculative.step_rate.steps_per_s == [1.0] * len(saved["batch_tokens"])  # read, not re-profiled
    # A flat table makes every draft pay off: the verify lengths are then the proposals' own.
    assert [o.token_ids for o in again.generate(prompts, GREEDY)] == plain
