"""scripts/train_drafter.py --smoke: a tiny random target, a few CPU steps, a loadable drafter, exact resume."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kimi_helix.presets import get_preset
from kimi_helix.speculative.dspark import DSparkDrafter
from kimi_helix.speculative.validator import validate_speculative_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_drafter.py"


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("train_drafter", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


SMOKE = ["--smoke", "--steps", "4", "--save-every", "2"]


def test_smoke_run_writes_a_drafter_that_fits_its_target(train, tmp_path, capsys):
    assert train([*SMOKE, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "drafter" in err and "4/4" in err  # the progress bar
    drafter = DSparkDrafter.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "checkpoint" / "train_state.json").read_text()) == {"step": 4}
    spec = {"method": "dspark", "model": str(tmp_path), "num_speculative_tokens": drafter.config.block_size}
    validate_speculative_config(spec, get_preset("tiny"), drafter.config, device="cpu")
    untrained = DSparkDrafter(drafter.config).state_dict()
    assert any(not torch.equal(untrained[k], v) for k, v in drafter.state_dict().items())


def test_resume_continues_exactly(train, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train([*SMOKE, "--out", str(straight)])
    train([*SMOKE, "--out", str(resumed), "--stop-at", "2"])
    assert not (resumed / "model.safetensors").exists()  # stopped early: only the checkpoint
    train([*SMOKE, "--out", str(resumed), "--resume"])
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_refuses_to_write_over_another_model(train, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    with pytest.raises(SystemExit, match="not a DSpark drafter"):
        train([*SMOKE, "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no checkpoint"):
        train([*SMOKE, "--out", str(tmp_path / "empty"), "--resume"])
