"""Smoke test of scripts/tune_kda_prefill.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import json

import pytest

from .conftest import load_script


def test_tune_smoke(tmp_path):
    from kimi_helix.kernels.kda import chunk

    tune = load_script("tune_kda_prefill")
    committed = {t: getattr(chunk, t) for t in tune.CANDIDATES}
    tune.main(["--smoke", "--out", str(tmp_path), "--lower-bound", "-5"])  # the bounded gate, computed in the kernel
    rows = [json.loads(line) for line in (tmp_path / "tune_kda_prefill.jsonl").read_text().splitlines()]
    assert rows and all(r["error"] is None and r["ms"] > 0 and r["lower_bound"] == -5 for r in rows), rows
    # INTRA_BOUNDED serves the bounded gate; the output kernel runs only where the state pass leaves o to it
    unused = {"INTRA"} | ({"OUTPUT"} if chunk.STATE["output"] else set())
    assert {r["table"] for r in rows} == set(tune.CANDIDATES) - unused
    for table in unused:
        with pytest.raises(SystemExit):
            tune.main(["--smoke", "--tables", table, "--lower-bound", "-5"])
    assert {t: getattr(chunk, t) for t in tune.CANDIDATES} == committed  # settings restored
