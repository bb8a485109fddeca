"""Bad input to the CLI, `LLM` and `SamplingParams`: each row names the exception type and a message substring, and
checks that nothing was written or deleted outside the test's own output folder (the inputs, the working
directory and the repository are compared file by file before and after)."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from kimi_helix import cli
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.tokenizer import TokenizerLoadError, build_byte_tokenizer

REPO = Path(__file__).resolve().parents[1]
UsageError = cli.UsageError

# CLI rows name folders as "{ckpt}", "{evil}", ... (the `inputs` fixture's) and "{out}" (the test's output folder).
GEN = ["generate", "--prompt", "x", "--max-new-tokens", "2"]
PLAN = ["plan", "--preset", "tiny", "--gpu-mem"]

CLI_ROWS = [
    # (argv, environment, exception, message)
    (GEN + ["--temperature", "nan"], {}, UsageError, "--temperature must be a finite number >= 0"),
    (GEN + ["--temperature", "-1"], {}, UsageError, "got -1.0"),
    (GEN + ["--temperature", "inf"], {}, UsageError, "got inf"),
    (GEN + ["--top-p", "0"], {}, UsageError, "--top-p must be in (0, 1], got 0.0"),
    (GEN + ["--top-p", "1.5"], {}, UsageError, "got 1.5"),
    (GEN + ["--max-new-tokens", "0"], {}, UsageError, "--max-new-tokens must be >= 1, got 0"),
    (GEN + ["--seed", "-1"], {}, UsageError, "--seed must be in [0, 2**64), got -1"),
    (GEN + ["--seed", str(2**64)], {}, UsageError, "--seed must be in [0, 2**64)"),
    (["generate", "--prompt", ""], {}, UsageError, "--prompt must not be empty"),
    (GEN + ["--device", "nonsense"], {}, UsageError, "--device 'nonsense' is not a device"),
    (GEN + ["--device", "meta"], {}, UsageError, "--device meta: only cpu and cuda are supported"),
    (GEN + ["--preset", "nope"], {}, UsageError, "--preset 'nope' is not a preset; choose from tiny"),
    (GEN + ["--model", "{ckpt}", "--preset", "tiny"], {}, SystemExit, "not allowed with argument"),
    (GEN + ["--model", "{evil}"], {}, UsageError, "tokenizer_config.json has an auto_map"),
    (GEN + ["--model", "{missing}"], {}, UsageError, "no config.json there"),
    (
        ["generate", "--model", "{short}", "--prompt", "abcdef"],
        {},
        UsageError,
        "= 38 exceeds the model's model_max_length=8",
    ),
    (GEN + ["--max-new-tokens", "two"], {}, SystemExit, "argument --max-new-tokens: invalid int value: 'two'"),
    (GEN, {"KIMI_HELIX_KERNEL_BACKEND": "cudnn"}, UsageError, "KIMI_HELIX_KERNEL_BACKEND='cudnn' is not a backend"),
    (GEN, {"KIMI_HELIX_ATTENTION_BACKEND": "flash"}, UsageError, "KIMI_HELIX_ATTENTION_BACKEND='flash'"),
    (["info", "--model", "{bad_json}"], {}, UsageError, "Expecting property name"),
    (["info", "--model", "{llama}"], {}, UsageError, "model_type is 'llama'"),
    (["info", "--preset", "nope"], {}, UsageError, "--preset 'nope' is not a preset"),
    (["plan", "--model", "{llama}", "--gpu-mem", "80GB"], {}, UsageError, "model_type is 'llama'"),
    (PLAN + ["lots"], {}, UsageError, "--gpu-mem: cannot read 'lots' as a byte count"),
    (PLAN + ["80e9"], {}, UsageError, "--gpu-mem: a number without a unit is GiB"),
    (PLAN + ["0"], {}, UsageError, "--gpu-mem: byte count must be positive"),
    (PLAN[:-1] + ["--gpu-mem=-5G"], {}, UsageError, "--gpu-mem: byte count must be positive"),
    (PLAN + ["nan"], {}, UsageError, "--gpu-mem: cannot read 'nan'"),
    (PLAN + ["141GB", "--tp", "3"], {}, UsageError, "tp * cp = 3 * 1"),
    (["init", "--preset", "tiny", "--out", "{full}"], {}, UsageError, "is not empty; pass --force"),
    (["init", "--preset", "tiny", "--out", "{file}"], {}, UsageError, "is a file, not a folder"),
    (["init", "--preset", "nope", "--out", "{out}/new"], {}, UsageError, "--preset 'nope' is not a preset"),
    (["init", "--preset", "tiny", "--out", "{out}/new", "--seed", "-3"], {}, UsageError, "--seed must be in"),
    (["init", "--preset", "tiny", "--out", "{out}/new", "--dtype", "int8"], {}, SystemExit, "invalid choice: 'int8'"),
]

LLM_ROWS = [
    # (LLM keyword arguments, exception, message)
    ({"max_model_len": 0}, ValueError, "max_model_len must be a positive int, got 0"),
    ({"max_model_len": -3}, ValueError, "max_model_len must be a positive int, got -3"),
    ({"max_model_len": 8.5}, ValueError, "max_model_len must be a positive int, got 8.5"),
    ({"max_model_len": 2**40}, ValueError, "exceeds the model's model_max_length"),
    ({"page_size": 0}, ValueError, "page_size must be a positive int, got 0"),
    ({"max_num_seqs": True}, ValueError, "max_num_seqs must be a positive int, got True"),
    ({"num_pages": 2.5}, ValueError, "num_pages must be a positive int, got 2.5"),
    ({"gpu_memory_utilization": 1.5}, ValueError, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ({"gpu_memory_utilization": math.nan}, ValueError, "gpu_memory_utilization must be in (0, 1], got nan"),
    ({"attention_backend": "cudnn"}, ValueError, "attention_backend must be None (automatic) or one of"),
    ({"dtype": torch.int8}, ValueError, "dtype must be None (the model's) or one of float32, bfloat16, float16"),
    ({"dtype": "half"}, ValueError, "got 'half'"),
    ({"device": "tpu"}, ValueError, "device 'tpu' is not a device"),
    ({"device": 0}, ValueError, "device must be None, a str such as 'cpu' or 'cuda:0', or a torch.device, got 0"),
    ({"device_map": "sequential"}, ValueError, "device_map must be None or 'auto', got 'sequential'"),
    ({"device_map": "auto"}, ValueError, "a loaded model is already placed"),
]

PROMPT_ROWS = [
    # (prompts, sampling params, tokenizer?, exception, message)
    ([[1.7, 2.2]], None, False, ValueError, "prompt token ids must be ints, got [1.7, 2.2]"),
    ([[3, None]], None, False, ValueError, "prompt token ids must be ints, got [None]"),
    ([[]], None, False, ValueError, "the prompt is empty"),
    ([[5] * 60], SamplingParams(max_tokens=8), False, ValueError, "= 68 exceeds max_model_len=64"),
    ([[1, 500]], None, False, ValueError, "prompt token ids must be in [0, 320)"),
    ([[-1]], None, False, ValueError, "prompt token ids must be in [0, 320)"),
    (["hello"], None, False, ValueError, "string prompts need a tokenizer"),
    ([[1, 2]], SamplingParams(stop="\n"), False, ValueError, "SamplingParams.stop=['\\n'] needs a tokenizer"),
    ([[1, 2], [3]], [SamplingParams()], False, ValueError, "got 2 prompts but 1 sampling_params"),
    ([[1], 7], None, True, ValueError, "a prompt must be a str or a list of token ids, got int"),
    ([b"bytes"], None, True, ValueError, "got bytes"),
]

PARAMS_ROWS = [
    # (SamplingParams keyword arguments, exception, message)
    ({"max_tokens": 0}, ValueError, "SamplingParams.max_tokens must be an int >= 1, got 0"),
    ({"max_tokens": 2.0}, ValueError, "SamplingParams.max_tokens must be an int >= 1, got 2.0"),
    ({"temperature": math.nan}, ValueError, "SamplingParams.temperature must be a finite number >= 0"),
    ({"temperature": -0.5}, ValueError, "got -0.5"),
    ({"top_p": 0.0}, ValueError, "SamplingParams.top_p must be in (0, 1]"),
    ({"top_k": -2}, ValueError, "SamplingParams.top_k must be an int >= -1"),
    ({"seed": 2**64}, ValueError, "SamplingParams.seed must be None or an int in [0, 2**64)"),
    ({"seed": -1}, ValueError, "got -1"),
    ({"stop": [""]}, ValueError, "SamplingParams.stop must be a str or a list of non-empty str"),
    ({"stop_token_ids": [-1]}, ValueError, "SamplingParams.stop_token_ids must be a list of ints >= 0"),
    ({"ignore_eos": "no"}, ValueError, "SamplingParams.ignore_eos must be a bool, got 'no'"),
]


def _files(root: Path) -> dict[Path, tuple[int, int]]:
    """Every file under `root` (skipping caches and dot-folders) with its size and modification time."""
    skip = {"__pycache__", ".git", ".pytest_cache", ".ruff_cache"}
    return {
        p: (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and not skip.intersection(p.relative_to(root).parts)
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Input folders the rows read: a tiny checkpoint and broken variants of it."""
    root = tmp_path_factory.mktemp("inputs")
    ckpt = root / "ckpt"
    assert cli.main(["init", "--preset", "tiny", "--out", str(ckpt)]) == 0
    evil = root / "evil"
    shutil.copytree(ckpt, evil)
    tok_config = json.loads((evil / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (evil / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (evil / "tokenization_evil.py").write_text("open(__file__ + '.PWNED', 'w')\n")
    short = root / "short"
    shutil.copytree(ckpt, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "model_max_length": 8}))
    (root / "bad_json").mkdir()
    (root / "bad_json" / "config.json").write_text('{"model_type": "kimi_k3",')
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "full").mkdir()
    (root / "full" / "notes.txt").write_text("keep me")
    (root / "file").write_text("a file, not a folder")
    return {
        "ckpt": ckpt,
        "evil": evil,
        "short": short,
        "bad_json": root / "bad_json",
        "llama": root / "llama",
        "full": root / "full",
        "file": root / "file",
        "missing": root / "missing",
        "root": root,
    }


@pytest.fixture
def untouched(inputs, tmp_path, monkeypatch):
    """Run a row in tmp_path/cwd with tmp_path/out as its only output folder; afterwards no file elsewhere (inputs,
    working directory, repository) may have appeared, changed or gone."""
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    out.mkdir()
    monkeypatch.chdir(cwd)
    watched = (inputs["root"], cwd, REPO)
    before = [_files(root) for root in watched]
    yield out
    assert [_files(root) for root in watched] == before


@pytest.fixture(scope="module")
def llm():
    from kimi_helix.modeling.model import KimiK3ForCausalLM
    from kimi_helix.presets import get_preset

    torch.manual_seed(0)
    model = KimiK3ForCausalLM(get_preset("tiny")).eval()
    return model, LLM(model, max_model_len=64), LLM(model, max_model_len=64, tokenizer=build_byte_tokenizer())


@pytest.mark.parametrize(("argv", "env", "error", "message"), CLI_ROWS, ids=[" ".join(r[0][:4]) for r in CLI_ROWS])
def test_cli(inputs, untouched, monkeypatch, capsys, argv, env, error, message):
    folders = {**{k: str(v) for k, v in inputs.items()}, "out": str(untouched)}
    argv = [a.format(**folders) for a in argv]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = cli._build_parser()
    with pytest.raises(error) as info:
        args = parser.parse_args(argv)
        args.run(args)
    shown = capsys.readouterr().err if error is SystemExit else str(info.value)
    assert message in shown
    if error is SystemExit:
        assert info.value.code == 2
    assert not any(p.name.endswith("PWNED") for p in inputs["root"].rglob("*"))


@pytest.mark.parametrize(("kwargs", "error", "message"), LLM_ROWS, ids=[next(iter(r[0])) for r in LLM_ROWS])
def test_llm_arguments(llm, untouched, kwargs, error, message):
    with pytest.raises(error) as info:
        LLM(llm[0], **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("prompts", "params", "with_tokenizer", "error", "message"), PROMPT_ROWS, ids=[r[4][:40] for r in PROMPT_ROWS]
)
def test_llm_prompts(llm, untouched, prompts, params, with_tokenizer, error, message):
    engine = llm[2] if with_tokenizer else llm[1]
    with pytest.raises(error) as info:
        engine.generate(prompts, params)
    assert message in str(info.value)
    assert not engine.scheduler.has_work and engine.cache.ledger.pages_in_use == 0


@pytest.mark.parametrize(("kwargs", "error", "message"), PARAMS_ROWS, ids=[str(r[0]) for r in PARAMS_ROWS])
def test_sampling_params(untouched, kwargs, error, message):
    with pytest.raises(error) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_llm_refuses_a_folder_whose_tokenizer_is_code(inputs, untouched):
    with pytest.raises(TokenizerLoadError, match="tokenizer_config.json has an auto_map"):
        LLM(inputs["evil"])
    assert not (inputs["evil"] / "tokenization_evil.py.PWNED").exists()
