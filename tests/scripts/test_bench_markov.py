"""Smoke test of scripts/bench_markov.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_markov.py"


def test_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_markov", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "markov.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in rows} == {"triton", "torch_ref"}
    keys = {"gpu", "date", "commit", "vocab", "rows", "slots", "ms", "floor_ms", "pct_of_bw_floor"}
    for r in rows:
        assert keys <= r.keys() and r["ms"] > 0 and r["tokens_equal_ref"] is True
