"""CPU smoke runs of scripts/train_target.py on a tiny token set built from two stdlib modules."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .conftest import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_target.py"


@pytest.fixture(scope="module")
def token_data(tmp_path_factory) -> Path:
    """train.npy / heldout.npy from the shipped tokenizer over two standard-library sources."""
    import heapq
    import textwrap

    from transformers import AutoTokenizer

    from kimi_helix.assets import DEMO_DIR

    tok = AutoTokenizer.from_pretrained(DEMO_DIR, trust_remote_code=False)
    out = tmp_path_factory.mktemp("demo_data")
    for split, module in (("train", heapq), ("heldout", textwrap)):
        ids = tok(Path(module.__file__).read_text(), add_special_tokens=False, verbose=False)["input_ids"]
        np.save(out / f"{split}.npy", np.array([*ids, tok.eos_token_id], dtype=np.uint16))
    return out


def test_smoke_cli_trains_saves_and_reproduces(token_data, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--data", str(token_data), "--out", str(tmp_path), "--check-repro"]
    subprocess.run(cmd, check=True, env=env, cwd=tmp_path, capture_output=True, text=True)

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and math.isfinite(summary["final_loss"])
    assert summary["repro_abs_diff"] <= 1e-3
    records = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and "event" not in r] == [1, 2, 3]
    assert any(r.get("event") == "eval" and r["heldout_bpb"] > 0 for r in records)

    from kimi_helix.modeling.model import KimiK3ForCausalLM

    model = KimiK3ForCausalLM.from_pretrained(tmp_path / "model")
    assert model.model.embed_tokens.weight.dtype.is_floating_point and model.config.tie_word_embeddings
    assert (tmp_path / "model" / "tokenizer.json").is_file()


def test_resume_continues_the_same_run(token_data, tmp_path):
    train = load_script("train_target")
    common = ["--smoke", "--data", str(token_data), "--steps", "3", "--eval-windows", "1"]
    straight = train.main([*common, "--out", str(tmp_path / "a")])
    # A zero time budget stops after the first step; the resumed run must land on the same losses.
    cut = train.main([*common, "--out", str(tmp_path / "b"), "--max-minutes", "0"])
    assert cut["steps"] == 1
    resumed = train.main([*common, "--out", str(tmp_path / "b"), "--resume"])
    assert resumed["steps"] == 3
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], abs=1e-6)
