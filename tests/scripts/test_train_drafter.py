"""scripts/train_drafter.py --smoke: a tiny random target, a few CPU steps, a loadable drafter, exact resume."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from kimi_helix.presets import get_preset
from kimi_helix.speculative.dspark import DSparkDrafter
from kimi_helix.speculative.validator import validate_speculative_config

from .conftest import load_script


@pytest.fixture(scope="module")
def train_module():
    return load_script("train_drafter")


@pytest.fixture(scope="module")
def train(train_module):
    return train_module.main


SMOKE = ["--smoke", "--steps", "4", "--save-every", "2"]


def test_smoke_run_writes_a_drafter_that_fits_its_target(train, tmp_path, capsys):
    assert train([*SMOKE, "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "drafter" in err and "4/4" in err  # the progress bar
    tau = re.search(r"held-out greedy tau at k=3: ([0-9.]+) \(acceptance by position ([0-9. ]+)\)", out)
    assert tau is not None and 1 <= float(tau.group(1)) <= 4 and len(tau.group(2).split()) == 3
    drafter = DSparkDrafter.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "checkpoint" / "train_state.json").read_text()) == {"step": 4, "steps": 4}
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


def test_time_budget_stops_the_run_and_still_writes_a_drafter(train, tmp_path, capsys):
    assert train(["--smoke", "--max-minutes", "0", "--eval-prompts", "0", "--out", str(tmp_path)]) == 0
    assert "step 1 of 6 (stopped by --max-minutes)" in capsys.readouterr().out
    assert json.loads((tmp_path / "checkpoint" / "train_state.json").read_text()) == {"step": 1, "steps": 6}
    DSparkDrafter.from_pretrained(tmp_path)


def test_steps_0_sizes_the_run_from_the_timed_steps(train_module, tmp_path, capsys, monkeypatch):
    # Steps 1..2 are timed; with the whole budget kept for the evaluation, the run is sized to end one step later.
    monkeypatch.setattr(train_module, "CALIB_STEPS", (1, 3))
    monkeypatch.setattr(train_module, "EVAL_RESERVE_S", 600.0)
    args = ["--smoke", "--steps", "0", "--max-minutes", "10", "--eval-prompts", "0", "--out", str(tmp_path)]
    assert train_module.main(args) == 0
    assert "step 4 of 4," in capsys.readouterr().out
    assert json.loads((tmp_path / "checkpoint" / "train_state.json").read_text()) == {"step": 4, "steps": 4}


def test_replay_rounds_follows_the_acceptance_chain(train_module):
    # anchor 0: 2 match -> emits 3, next anchor 3: 0 match -> emits 1, anchor 4: 5 match, capped at k=3 -> emits 4,
    # next anchor 8: past the end
    rounds, emitted, accepted_at = train_module.replay_rounds([2, 9, 9, 0, 5, 9, 9, 9], k=3)
    assert (rounds, emitted, accepted_at) == (3, 3 + 1 + 4, [2, 2, 1])
    assert train_module.replay_rounds([0, 0, 0], k=2) == (3, 3, [0, 0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_drafter_parameter_learns_inside_reference_kernels(train_module, device):
    """On the GPU the drafter's norms, SwiGLU and rotary would run forward-only Triton kernels; inside
    `reference_kernels` every trainable parameter gets a gradient, and the choice is restored afterwards."""
    args = train_module.parse_args(["--smoke", "--out", "unused", "--device", device])
    target, _ = train_module.load_target(args, torch.device(device))
    drafter = train_module.build_drafter(args, target, torch.device(device))
    drafter.bind_target(target)
    capture = train_module.TargetFeatureCapture(target, drafter.config.target_layer_ids).attach()
    seqs = torch.randint(0, 100, (2, args.prompt_len + args.gen_len), device=device)
    with train_module.reference_kernels(drafter):
        assert drafter.norm.backends.kernels == "torch"
        loss = train_module.train_step(drafter, target, capture, seqs, args, torch.Generator().manual_seed(0), device)
        loss.total.backward()
    assert drafter.norm.backends.kernels is None
    assert all(layer.self_attn.backends.kernels is None for layer in drafter.layers)
    trainable = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())


def test_refuses_to_write_over_another_model(train, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    with pytest.raises(SystemExit, match="not a DSpark drafter"):
        train([*SMOKE, "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no checkpoint"):
        train([*SMOKE, "--out", str(tmp_path / "empty"), "--resume"])
