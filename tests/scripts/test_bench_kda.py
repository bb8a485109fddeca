"""Smoke test of scripts/bench_kda.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

H, K, V = 2, 32, 16  # K != V so a transposed state cannot pass; K spans two 16-wide slices of the intra kernel


def test_chunk_bench_smoke(tmp_path):
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_kda.py"
    spec = importlib.util.spec_from_file_location("bench_kda", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--phase", "prefill", "--smoke", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "kda_prefill.jsonl").read_text().splitlines()]
    assert rows and {"gpu", "date", "commit", "T", "H", "backend", "ms", "tflops"} <= rows[0].keys()
    assert {r["backend"] for r in rows} >= {"triton", "triton_gate"}


def test_recurrent_bench_smoke(tmp_path):
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_kda.py"
    spec = importlib.util.spec_from_file_location("bench_kda", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--phase", "decode", "--smoke", "--sweep", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "kda_decode.jsonl").read_text().splitlines()]
    assert rows and {"gpu", "date", "commit", "n", "ms", "tbps", "copy_tbps"} <= rows[0].keys()
    assert all(r["ms"] > 0 and r["tbps"] > 0 for r in rows)
    forced = {(r["bv"], r["num_warps"]) for r in rows if r["config"] == "forced"}
    assert forced == set(bench.SWEEP)
