"""Smoke test of scripts/bench_kda.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import json

from .conftest import load_script

H, K, V = 2, 32, 16  # K != V so a transposed state cannot pass; K spans two 16-wide slices of the intra kernel


def test_chunk_bench_smoke(tmp_path):
    bench = load_script("bench_kda")
    bench.main(["--phase", "prefill", "--smoke", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "kda_prefill.jsonl").read_text().splitlines()]
    assert rows and {"gpu", "date", "commit", "T", "H", "backend", "ms", "tflops"} <= rows[0].keys()
    assert {r["backend"] for r in rows} >= {"triton", "triton_gate"}


def test_recurrent_bench_smoke(tmp_path):
    bench = load_script("bench_kda")
    bench.main(["--phase", "decode", "--smoke", "--sweep", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "kda_decode.jsonl").read_text().splitlines()]
    assert rows and {"gpu", "date", "commit", "n", "ms", "tbps", "copy_tbps"} <= rows[0].keys()
    assert all(r["ms"] > 0 and r["tbps"] > 0 for r in rows)
    forced = {(r["bv"], r["num_warps"]) for r in rows if r["config"] == "forced"}
    assert forced == set(bench.SWEEP)
