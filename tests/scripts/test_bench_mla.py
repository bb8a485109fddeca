"""Smoke test of scripts/bench_mla.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import os


def test_bench_smoke(tmp_path):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    try:
        import bench_mla
    finally:
        sys.path.pop(0)
    bench_mla.main(["--smoke", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "mla_decode.jsonl").read_text().splitlines()]
    assert rows and all(r.get("error") is None for r in rows), rows
    fields = {"gpu", "date", "commit", "b", "h", "s_q", "s_k", "kv_dtype", "backend", "ms", "tbps", "tflops"}
    assert fields | {"graph_ms"} <= set(rows[0])
