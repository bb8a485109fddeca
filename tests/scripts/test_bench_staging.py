"""Smoke test of scripts/bench_staging.py: it stages verify steps on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import json

from .conftest import load_script


def test_bench_smoke(tmp_path):
    bench = load_script("bench_staging")
    out = tmp_path / "staging.jsonl"
    bench.main(["--smoke", "--k", "3", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert {"gpu", "date", "commit", "model", "device", "k", "calls"} <= r.keys()
        assert r["k"] == 3 and r["us_per_call"] > 0


def test_the_step_is_a_verify_step_of_every_sequence():
    bench = load_script("bench_staging")
    from kimi_helix import KimiK3ForCausalLM
    from kimi_helix.modeling.batch import Phase
    from kimi_helix.presets import get_preset

    llm, step = bench.verify_step_llm(KimiK3ForCausalLM(get_preset("tiny")).eval(), 3, 2, "cpu")
    assert step.phases == [Phase.VERIFY] * 3 and step.num_tokens == [3, 3, 3]
    inputs, rows = llm.runner.prepare(step)
    assert inputs.input_ids.tolist() == [11, 3, 4] * 3 and [r.stop - r.start for r in rows] == [3, 3, 3]
