"""Smoke test of scripts/bench_markov.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import json

from .conftest import load_script


def test_bench_smoke(tmp_path):
    bench = load_script("bench_markov")
    bench.main(["--smoke", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "markov.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in rows} == {"triton", "torch_ref"}
    keys = {"gpu", "date", "commit", "vocab", "rows", "slots", "ms", "floor_ms", "pct_of_bw_floor"}
    for r in rows:
        assert keys <= r.keys() and r["ms"] > 0 and r["tokens_equal_ref"] is True
