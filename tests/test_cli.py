import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kimi_helix import KimiK3ForCausalLM, cli
from kimi_helix.cli import main
from kimi_helix.modeling.accounting import count_parameters
from kimi_helix.presets import PRESETS, get_preset

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert main(["init", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    return out


def test_presets_lists_every_preset(capsys):
    code, out, _ = run(capsys, "presets")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["name", "layers"]
    assert [line.split()[0] for line in lines[1:]] == list(PRESETS)
    assert "49.12B / 3.11B" in out


def test_python_m_kimi_helix_presets():
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_helix", "presets"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "kimi-linear-48b-a3b" in proc.stdout


def test_info_kimi_linear_48b(capsys):
    total, active = count_parameters(get_preset("kimi-linear-48b-a3b"))
    assert total == 49_122_681_728
    assert 2.9e9 < active < 3.5e9
    code, out, _ = run(capsys, "info", "--preset", "kimi-linear-48b-a3b")
    assert code == 0
    assert f"49.12B total ({total:,}), 3.11B active per token ({active:,})" in out
    assert "KKKM KKKM KKKM KKKM KKKM KKKM KKM" in out
    assert "8,064 B (7.9 KiB) per token" in out
    assert "43,417,600 B (41.4 MiB) per sequence" in out


def test_info_reads_only_config_json_of_a_kimi_linear_checkpoint(capsys, tmp_path):
    # A Kimi-Linear config.json as shipped (metadata included) and no weights at all.
    raw = {
        **PRESETS["kimi-linear-48b-a3b"],
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
        "dtype": "bfloat16",
        "transformers_version": "4.57.0",
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    code, out, _ = run(capsys, "info", "--model", str(tmp_path))
    assert code == 0
    assert "49,122,681,728" in out


def test_init_writes_a_loadable_checkpoint(tiny_ckpt):
    model = KimiK3ForCausalLM.from_pretrained(tiny_ckpt)
    assert model.config.to_dict()["linear_attn_config"] == PRESETS["tiny"]["linear_attn_config"]
    assert sum(p.numel() for p in model.parameters()) == count_parameters(get_preset("tiny"))[0]
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert tok.decode(tok("héllo")["input_ids"]) == "héllo"


def test_init_is_seeded(tmp_path):
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        assert main(["init", "--preset", "tiny", "--out", str(tmp_path / name), "--seed", seed]) == 0
    a, b, c = (KimiK3ForCausalLM.from_pretrained(tmp_path / n).lm_head.weight for n in "abc")
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_init_dtype(tmp_path):
    assert main(["init", "--preset", "tiny-k3", "--out", str(tmp_path), "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model = KimiK3ForCausalLM.from_pretrained(tmp_path)
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_init_refuses_a_non_empty_dir_unless_forced(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    code, _, err = run(capsys, "init", "--preset", "tiny", "--out", str(tmp_path))
    assert code == 2
    assert "not empty" in err and "--force" in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]

    code, _, _ = run(capsys, "init", "--preset", "tiny", "--out", str(tmp_path), "--force")
    assert code == 0
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_init_refuses_a_model_that_cannot_fit(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_memory_bytes", lambda device: 1024)
    code, _, err = run(capsys, "init", "--preset", "tiny", "--out", str(tmp_path / "ckpt"))
    assert code == 2
    assert f"need {count_parameters(get_preset('tiny'))[0] * 4:,} B" in err
    assert not (tmp_path / "ckpt").exists()


def test_generate_from_a_checkpoint_is_deterministic(capsys, tiny_ckpt):
    args = ["generate", "--model", str(tiny_ckpt), "--prompt", "The capital of France is", "--max-new-tokens", "8"]
    code, greedy, _ = run(capsys, *args)
    assert code == 0 and greedy.strip()
    assert run(capsys, *args)[1] == greedy

    sampled = [run(capsys, *args, "--temperature", "1.5", "--top-p", "0.9", "--seed", s)[1] for s in "112"]
    assert sampled[0] == sampled[1]
    assert sampled[0] != sampled[2]


def test_generate_without_a_model_uses_a_random_tiny_one(capsys):
    code, out, err = run(capsys, "generate", "--prompt", "Hello", "--max-new-tokens", "4")
    assert code == 0 and out.strip()
    assert "random" in err and "tiny" in err


def test_generate_escapes_control_characters(capsys, tiny_ckpt, monkeypatch):
    monkeypatch.setattr(
        KimiK3ForCausalLM, "generate", lambda self, ids, **kw: torch.cat([ids, ids.new_tensor([[27, 65]])], 1)
    )
    code, out, _ = run(capsys, "generate", "--model", str(tiny_ckpt), "--prompt", "x")
    assert code == 0
    assert out == "\\x1bA\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["info", "--preset", "nope"], "invalid choice: 'nope'"),
        (["init", "--preset", "nope", "--out", "x"], "kimi-linear-48b-a3b"),
        (["init", "--preset", "tiny", "--out", "x", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["generate", "--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["generate", "--prompt", "", "--max-new-tokens", "1"], "--prompt must not be empty"),
        (["generate", "--prompt", "x", "--device", "nonsense"], "--device 'nonsense' is not a device"),
        (["generate", "--prompt", "x", "--model", "does/not/exist"], "no config.json"),
        (["info", "--model", "does/not/exist"], "no config.json"),
        (["info"], "one of the arguments --model --preset is required"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
