"""Smoke test of scripts/bench_mla_prefill.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the CPU path; GPU boxes run the real benchmark (and triton 3.6's interpreter "
    "cannot take runtime loop bounds under numpy >= 2.3)",
)
def test_bench_script_smoke(tmp_path):
    """scripts/bench_mla_prefill.py --smoke runs the interpreter on a tiny case and writes well-formed JSONL."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_mla_prefill.py"
    out = tmp_path / "mla_prefill.jsonl"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    fields = {"gpu", "date", "commit", "case", "tq", "tk", "heads", "dqk", "dv", "dtype", "config", "kernel_ms", "ms"}
    assert fields | {"tflops"} <= set(rec)
    assert rec["rel_err"] < 1e-5 and rec["lse_rel_err"] < 1e-5
