"""Smoke test of scripts/kernel_resources.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kernel_resources_smoke():
    """scripts/kernel_resources.py compiles for sm_90 without a GPU (so outside the interpreter) and reads the cubin."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "kernel_resources.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(script), "--ops", "kda", "--only", "kda gate"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    row = [line for line in out.stdout.splitlines() if line.startswith("| kda gate")]
    assert len(row) == 1, out.stdout
    regs = int(row[0].split("|")[4])
    assert 0 < regs <= 255, row
