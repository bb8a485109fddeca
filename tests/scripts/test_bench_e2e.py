"""The end-to-end benchmark's CPU smoke run: tiny shapes, every row written with the fields the issue asks for."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_e2e.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_run_writes_every_case(tmp_path, capsys):
    out = tmp_path / "e2e.jsonl"
    assert _load().main(["--device", "cpu", "--preset", "tiny", "--layers", "3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ours = [r for r in rows if r["phase"] == "decode" and r.get("mode") == "eager"]
    verify = [r for r in rows if r["phase"] == "verify"]
    hf = [r for r in rows if r["case"] == "decode" and str(r.get("mode")).startswith("transformers")]
    prefill = [r for r in rows if r["phase"] == "prefill"]
    assert [(r["batch"], r["context"]) for r in ours] == [(1, 16), (2, 16)]
    for r in ours:
        assert {"gpu", "date", "commit", "layers", "batch", "context", "ms_per_step", "kernels_per_step", "floor_ms",
                "pct_of_floor"} <= set(r)  # fmt: skip
        assert r["layers"] == 3 and r["ms_per_step"] > 0 and r["floor_ms"] > 0 and r["pct_of_floor"] > 0
        assert r["experts_touched_mean"] >= 1
    assert [(r["batch"], r["context"]) for r in hf] == [(1, 16)] and hf[0]["ms_per_step"] > 0
    assert ours[0]["speedup_vs_hf"] == round(hf[0]["ms_per_step"] / ours[0]["ms_per_step"], 2)
    assert [(r["batch"], r["context"], r["draft_tokens"]) for r in verify] == [(1, 16, 4), (2, 16, 4)]
    for v, d in zip(verify, ours):
        assert v["ms_per_step"] > 0 and v["verify_over_decode"] == round(v["ms_per_step"] / d["ms_per_step"], 3)
        assert v["floor_ms"] > d["floor_ms"] and v["floor_over_decode"] == round(v["floor_ms"] / d["floor_ms"], 3)
    assert len(prefill) == 1 and prefill[0]["prefill_tokens_per_s"] > 0
    table = capsys.readouterr().out
    assert "| case |" in table and "pct_of_floor" in table


def test_layers_truncate_the_preset():
    config = _load().truncated_config("kimi-linear-48b-a3b", 5)
    assert config.num_hidden_layers == 5 and config.layer_types.count("full_attention") == 1
