import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import kimi_helix
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


@pytest.mark.parametrize(
    "extra", [[], ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]], ids=["plain", "speculative"]
)
def test_generate_without_a_model_uses_the_shipped_demo_model(capsys, monkeypatch, extra):
    """The demo model stands in, and says so on stderr, on the plain and the speculative path alike."""
    from kimi_helix.assets import demo_model_dir

    loaded = []
    real = KimiK3ForCausalLM.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        loaded.append(path)
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(KimiK3ForCausalLM, "from_pretrained", classmethod(spy))
    code, out, err = run(capsys, "generate", "--prompt", "def f(x):", "--max-new-tokens", "4", *extra)
    assert code == 0 and out.strip()
    assert "demo model" in err
    assert [str(p) for p in loaded] == [str(demo_model_dir())]


def fake_generate(new_tokens: list[int]):
    """A `generate` that streams `new_tokens` one at a time through the CLI's streamer."""

    def generate(self, ids, streamer, **kwargs):
        streamer.put(ids[0])  # the prompt, which the streamer skips
        for token in new_tokens:
            streamer.put(ids.new_tensor([token]))
        streamer.end()
        return torch.cat([ids, ids.new_tensor([new_tokens])], 1)

    return generate


def test_generate_escapes_control_characters(capsys, tiny_ckpt, monkeypatch):
    monkeypatch.setattr(KimiK3ForCausalLM, "generate", fake_generate([27, 65]))
    code, out, _ = run(capsys, "generate", "--model", str(tiny_ckpt), "--prompt", "x")
    assert code == 0
    assert out == "\\x1bA\n"


def test_generate_streams_text_as_it_is_generated(capsys, tiny_ckpt, monkeypatch):
    seen: list[str] = []

    def generate(self, ids, streamer, **kwargs):
        streamer.put(ids[0])
        for word in (b"one ", b"two ", b"three"):
            streamer.put(ids.new_tensor(list(word)))
            seen.append(capsys.readouterr().out)
        streamer.end()
        return ids

    monkeypatch.setattr(KimiK3ForCausalLM, "generate", generate)
    code, out, _ = run(capsys, "generate", "--model", str(tiny_ckpt), "--prompt", "x")
    assert code == 0
    # Each finished word is on stdout before the next one is generated (transformers >= 5.24 also prints a word
    # still in progress when it is all letters); the rest is flushed at the end.
    assert seen[:2] == ["one ", "two "]
    assert "".join(seen) + out == "one two three\n"


def test_generate_real_model_stream_equals_decode(capsys, tiny_ckpt):
    model = KimiK3ForCausalLM.from_pretrained(tiny_ckpt)
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    ids = tok("Hi", return_tensors="pt").input_ids
    expected = tok.decode(model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :])
    code, out, _ = run(capsys, "generate", "--model", str(tiny_ckpt), "--prompt", "Hi", "--max-new-tokens", "6")
    assert code == 0
    assert out == expected.translate(cli._ESCAPE_CONTROLS) + "\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["info", "--preset", "nope"], "--preset 'nope' is not a preset; choose from tiny"),
        (["init", "--preset", "nope", "--out", "x"], "kimi-linear-48b-a3b"),
        (["init", "--preset", "tiny", "--out", "x", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["generate", "--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["generate", "--prompt", "x", "--temperature", "inf"], "got inf"),
        (["generate", "--prompt", "x", "--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
        (["generate", "--prompt", "x", "--seed", str(2**64)], "--seed must be in [0, 2**64)"),
        (["generate", "--prompt", "x", "--seed", "-1"], "--seed must be in [0, 2**64), got -1"),
        (["plan", "--preset", "tiny", "--gpu-mem", "80e9"], "--gpu-mem: a number without a unit is GiB"),
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


def test_help_shows_defaults(capsys):
    for argv, shown in (
        (["generate", "--help"], ["(default: 32)", "(default: 0.0)", "(default: 1.0)"]),
        (["plan", "--help"], ["(default: 64)", "(default: 0.9)", "(default: auto)"]),
        (["init", "--help"], ["(default: float32)"]),
    ):
        code, out, _ = run(capsys, *argv)
        assert code == 0
        assert all(s in " ".join(out.split()) for s in shown), out
        assert "(default: None)" not in out


def test_cli_imports_neither_torch_nor_transformers_for_help():
    # `kimi_helix/__init__.py` imports the models (it registers them with transformers' Auto classes); what the
    # CLI module adds on top must be only the standard library, so the package is bypassed here.
    code = (
        "import sys, types; pkg = types.ModuleType('kimi_helix'); pkg.__path__ = [sys.argv[1]]; "
        "sys.modules['kimi_helix'] = pkg; from kimi_helix.cli import main; "
        "assert main(['--help']) == 0 and main(['plan', '--help']) == 0; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers', 'numpy') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "kimi_helix")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("141", 141 * 2**30), ("141G", 141 * 2**30), ("141GiB", 141 * 2**30), ("141GB", 141 * 10**9), ("80e9B", 80e9)],
)
def test_gpu_mem_units(capsys, value, expected):
    code, out, err = run(capsys, "plan", "--preset", "tiny", "--gpu-mem", value)
    assert code == 0, err
    assert f"{int(expected):,} B" in out


def evil_folder(root: Path, tiny_ckpt: Path) -> Path:
    """A copy of the tiny checkpoint whose tokenizer asks for `tokenization_evil.py`, which would write PWNED."""
    import shutil

    folder = root / "evil"
    shutil.copytree(tiny_ckpt, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text(
        "import pathlib\n"
        "pathlib.Path(__file__).with_name('PWNED').write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    return folder


def test_generate_never_runs_a_checkpoint_tokenizer_code(capsys, tmp_path, tiny_ckpt, monkeypatch):
    folder = evil_folder(tmp_path, tiny_ckpt)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\n"))  # yes to any trust_remote_code prompt
    code, out, err = run(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert code == 2
    assert not (folder / "PWNED").exists()
    assert "tokenizer_config.json has an auto_map" in err and "trust_remote_code=False" in err
    assert "Traceback" not in err and out == ""


def test_generate_checks_prompt_plus_new_tokens_against_the_model_limit(capsys, tmp_path, tiny_ckpt):
    import shutil

    folder = tmp_path / "short"
    shutil.copytree(tiny_ckpt, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_max_length"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "generate", "--model", str(folder), "--prompt", "abc", "--max-new-tokens", "6")
    assert code == 2
    assert "--prompt (3 tokens) + --max-new-tokens (6) = 9 exceeds the model's model_max_length=8" in err
    assert run(capsys, "generate", "--model", str(folder), "--prompt", "abc", "--max-new-tokens", "5")[0] == 0


def test_checkpoint_errors_print_one_line(capsys, tmp_path, tiny_ckpt):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    code, _, err = run(capsys, "generate", "--model", str(folder), "--prompt", "x")
    assert code == 2
    assert err.startswith(f"kimi-helix: error: --model {folder}") and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["info", "plan"])
def test_info_and_plan_read_the_checked_config(capsys, tmp_path, command):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    extra = ["--gpu-mem", "80GB"] if command == "plan" else []
    code, _, err = run(capsys, command, "--model", str(tmp_path), *extra)
    assert code == 2
    assert "model_type is 'llama'" in err and err.count("\n") == 1


def test_forced_triton_backend_on_cpu_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(KIMI_HELIX_KERNEL_BACKEND="triton", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_helix", "generate", "--prompt", "hi", "--max-new-tokens", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if torch.cuda.is_available():
        pytest.skip("triton serves these ops on a GPU")
    assert proc.returncode == 2
    assert "kernel backend 'triton' cannot serve" in proc.stderr and "KIMI_HELIX_KERNEL_BACKEND" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_backend_variable_is_named(capsys, monkeypatch):
    monkeypatch.setenv("KIMI_HELIX_KERNEL_BACKEND", "cudnn")
    code, _, err = run(capsys, "generate", "--prompt", "x", "--max-new-tokens", "1")
    assert code == 2
    assert "KIMI_HELIX_KERNEL_BACKEND='cudnn' is not a backend; use one of torch, triton" in err


@pytest.mark.skipif(
    not hasattr(kimi_helix, "__getattr__"), reason="kimi_helix/__init__.py imports the models eagerly (not lazy)"
)
@pytest.mark.parametrize("argv", [["--help"], ["presets"]])
def test_python_m_kimi_helix_help_and_presets_do_not_import_torch(argv):
    code = (
        f"import runpy, sys; sys.argv = ['kimi-helix', *{argv!r}]\n"
        "try:\n    runpy.run_module('kimi_helix', run_name='__main__')\nexcept SystemExit as exit_:\n"
        "    assert not exit_.code\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("command", [["info"], ["plan", "--gpu-mem", "80"]])
def test_info_and_plan_refuse_a_config_without_its_shapes(capsys, tmp_path, command):
    """No 48B defaults for a config.json that does not state its shapes: the missing fields are named."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_linear", "vocab_size": 320}))
    code, out, err = run(capsys, command[0], "--model", str(tmp_path), *command[1:])
    assert code == 2 and not out
    assert "lacks hidden_size, intermediate_size, num_hidden_layers, num_attention_heads" in err


def test_speculative_generate_equals_plain_greedy(capsys, tiny_ckpt):
    plain = run(capsys, "generate", "--model", str(tiny_ckpt), "--prompt", "abcabcabc", "--max-new-tokens", "12")
    spec = run(
        capsys, "generate", "--model", str(tiny_ckpt), "--prompt", "abcabcabc", "--max-new-tokens", "12",
        "--speculative-method", "ngram", "--num-speculative-tokens", "3",
    )  # fmt: skip
    assert plain[0] == spec[0] == 0 and plain[1] == spec[1] and plain[1].strip()


def test_unsupported_speculative_config_is_one_line_before_any_weights(capsys, tmp_path):
    """The validator runs on config.json alone: a folder without weights still gets the reason, not a load error."""
    assert run(capsys, "init", "--preset", "tiny", "--out", str(tmp_path / "full"))[0] == 0
    (tmp_path / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    code, out, err = run(
        capsys, "generate", "--model", str(tmp_path), "--prompt", "x", "--speculative-method", "ngram",
        "--num-speculative-tokens", "9",
    )  # fmt: skip
    assert code == 2 and not out and len(err.strip().splitlines()) == 1
    assert "num_speculative_tokens" in err and "1..8" in err
