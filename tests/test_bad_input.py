"""A table of bad inputs to the config, `from_pretrained`, `save_pretrained`, the CLI, `LLM` and `SamplingParams`:
each gives a clear exception of one type whose message names the field, file or value, and nothing is written or
deleted outside the output folder (compared byte for byte before and after)."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_helix import CheckpointError, ConfigError, KimiK3Config, KimiK3ForCausalLM, cli
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.tokenizer import TokenizerLoadError, build_byte_tokenizer

from .modeling.conftest import k3_kwargs, tiny_kwargs

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A single-file tiny checkpoint, copied for each row."""
    path = tmp_path_factory.mktemp("template")
    torch.manual_seed(0)
    KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs())).save_pretrained(path)
    return path


def snapshot(root: Path, skip: Path) -> dict[str, bytes]:
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == skip:
            dirnames.clear()
            continue
        for name in filenames:
            p = Path(dirpath) / name
            files[str(p.relative_to(root))] = b"<fifo>" if not p.is_file() else p.read_bytes()
    return files


# ---------------------------------------------------------------- row helpers: each edits the checkpoint folder
def config_field(**fields):
    def edit(ckpt: Path):
        raw = json.loads((ckpt / "config.json").read_text())
        raw.update(fields)
        (ckpt / "config.json").write_text(json.dumps(raw))

    return edit


def config_without(*names):
    def edit(ckpt: Path):
        raw = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in names}))

    return edit


def config_text(text: str):
    return lambda ckpt: (ckpt / "config.json").write_text(text)


def tensors(edit_fn):
    def edit(ckpt: Path):
        t = load_file(ckpt / WEIGHTS)
        edit_fn(t)
        save_file(t, ckpt / WEIGHTS, metadata={"format": "pt"})

    return edit


def shards_with(mutate):
    """Re-save sharded, then let `mutate(ckpt, index)` edit the folder or the index."""

    def edit(ckpt: Path):
        model = KimiK3ForCausalLM.from_pretrained(ckpt)
        (ckpt / WEIGHTS).unlink()
        model.save_pretrained(ckpt, max_shard_size="40KB")
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        mutate(ckpt, index)
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def remap(name: str, shard: str):
    return shards_with(lambda ckpt, index: index["weight_map"].__setitem__(name, shard))


def fifo_shard(ckpt, index):
    os.mkfifo(ckpt / "pipe.safetensors")
    index["weight_map"]["model.norm.weight"] = "pipe.safetensors"


def poison(value):
    def edit(t):
        t["model.norm.weight"][0] = value

    return tensors(edit)


def nothing(ckpt):
    pass


# (id, edit the checkpoint folder, load keyword args, exception, message substring)
LOAD_ROWS = [
    # config.json values (item 4)
    ("bool-as-string", config_field(mla_use_nope="false"), {}, ConfigError, "mla_use_nope must be true or false"),
    ("no-hidden-size", config_without("hidden_size"), {}, ConfigError, "lacks hidden_size"),
    ("no-shapes", config_without("num_hidden_layers", "vocab_size"), {}, ConfigError, "lacks vocab_size, num_hidden"),
    ("tie-as-string", config_field(tie_word_embeddings="false"), {}, ConfigError, "tie_word_embeddings must be"),
    ("rope-theta-zero", config_field(rope_theta=0), {}, ConfigError, "rope_theta must be a number > 0"),
    ("rope-theta-str", config_field(rope_theta="1e4"), {}, ConfigError, "rope_theta must be a number > 0, got '1e4'"),
    ("negative-scaling", config_field(routed_scaling_factor=-2.0), {}, ConfigError, "routed_scaling_factor"),
    ("eps-string", config_field(rms_norm_eps="1e-5"), {}, ConfigError, "rms_norm_eps must be a number > 0"),
    ("hidden-float", config_field(hidden_size=64.0), {}, ConfigError, "hidden_size must be a positive int"),
    ("layers-zero", config_field(num_hidden_layers=0), {}, ConfigError, "num_hidden_layers must be a positive int"),
    ("experts-negative", config_field(num_experts=-1), {}, ConfigError, "num_experts must be an int >= 0"),
    ("topk-too-many", config_field(num_experts_per_token=9), {}, ConfigError, "num_experts_per_token (9)"),
    ("router-relu", config_field(moe_router_activation_func="relu"), {}, ConfigError, "moe_router_activation_func"),
    ("act-gelu", config_field(hidden_act="gelu"), {}, ConfigError, "hidden_act must be 'silu'"),
    ("rope-scaling", config_field(rope_scaling={"type": "yarn"}), {}, ConfigError, "rope_scaling must be None"),
    ("mtp-layers", config_field(num_nextn_predict_layers=1), {}, ConfigError, "num_nextn_predict_layers must be 0"),
    ("router-logits", config_field(output_router_logits=True), {}, ConfigError, "output_router_logits must be"),
    ("attn-bias", config_field(attention_bias=True), {}, ConfigError, "attention_bias must be False"),
    ("qk-head-dim", config_field(qk_head_dim=7), {}, ConfigError, "qk_head_dim (7) must equal"),
    (
        "mlp-types-inexpressible",
        config_field(mlp_layer_types=["dense", "sparse", "dense", "sparse"], first_k_dense_replace=None),
        {},
        ConfigError,
        "cannot be expressed as first_k_dense_replace",
    ),
    (
        "mlp-types-disagree",
        config_field(mlp_layer_types=["dense", "dense", "sparse", "sparse"]),
        {},
        ConfigError,
        "disagrees with first_k_dense_replace=1",
    ),
    (
        "layer-zero",
        config_field(linear_attn_config={"kda_layers": [0, 1, 2], "full_attn_layers": [4]}),
        {},
        ConfigError,
        "kda_layers holds 0",
    ),
    ("config-list", config_text("[1, 2]"), {}, ConfigError, "must hold a JSON object"),
    ("lac-a-list", config_field(linear_attn_config=[1, 2]), {}, ConfigError, "linear_attn_config must be an object"),
    ("eos-a-string", config_field(eos_token_id="2"), {}, ConfigError, "eos_token_id must be an int >= 0, got '2'"),
    ("kda-heads-float", config_field(linear_num_heads=2.0), {}, ConfigError, "linear_attn_config.num_heads must be"),
    ("config-bad-json", config_text("{"), {}, CheckpointError, "config.json' is not valid JSON"),
    ("config-model-type", config_field(model_type="llama"), {}, CheckpointError, "model_type is 'llama'"),
    ("config-dtype", config_field(dtype="float77"), {}, ConfigError, "dtype must name a torch dtype"),
    # the folder's files (item 3)
    ("no-config", lambda c: (c / "config.json").unlink(), {}, CheckpointError, "no config.json"),
    ("no-weights", lambda c: (c / WEIGHTS).unlink(), {}, CheckpointError, "no model.safetensors"),
    ("pickle-only", lambda c: (c / WEIGHTS).rename(c / "pytorch_model.bin"), {}, CheckpointError, "pickle-based"),
    (
        "weights-a-folder",
        lambda c: ((c / WEIGHTS).unlink(), (c / WEIGHTS).mkdir()),
        {},
        CheckpointError,
        "is not a regular file",
    ),
    (
        "truncated",
        lambda c: (c / WEIGHTS).write_bytes((c / WEIGHTS).read_bytes()[:-64]),
        {},
        CheckpointError,
        "model.safetensors' is not a readable safetensors file",
    ),
    ("garbage", lambda c: (c / WEIGHTS).write_bytes(b"\x10" * 100), {}, CheckpointError, "not a readable safetensors"),
    ("index-absolute", remap("model.norm.weight", "/etc/hostname"), {}, CheckpointError, "to '/etc/hostname'"),
    ("index-dotdot", remap("model.norm.weight", "../x.safetensors"), {}, CheckpointError, "inside the checkpoint"),
    ("index-not-str", remap("model.norm.weight", 3), {}, CheckpointError, "maps 'model.norm.weight' to 3"),
    ("index-no-map", shards_with(lambda c, i: i.pop("weight_map")), {}, CheckpointError, "has no weight_map"),
    (
        "index-missing-shard",
        remap("model.norm.weight", "model-gone.safetensors"),
        {},
        CheckpointError,
        "model-gone.safetensors' does not exist",
    ),
    ("index-fifo", shards_with(fifo_shard), {}, CheckpointError, "pipe.safetensors' is not a regular file"),
    (
        "int-weights",
        tensors(lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})),
        {},
        CheckpointError,
        "'model.norm.weight' in model.safetensors is I32",
    ),
    (
        "bool-weights",
        tensors(lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.bool)})),
        {},
        CheckpointError,
        "is BOOL",
    ),
    (
        "wrong-shape",
        tensors(lambda t: t.update({"model.norm.weight": torch.ones(63)})),
        {},
        CheckpointError,
        "has shape [63], the model expects [64]",
    ),
    (
        "unexpected",
        tensors(lambda t: t.update({"model.extra": torch.ones(1)})),
        {},
        CheckpointError,
        "unexpected tensor 'model.extra'",
    ),
    ("missing", tensors(lambda t: t.pop("model.norm.weight")), {}, CheckpointError, "missing 1 tensors: model.norm"),
    (
        "expert-out-of-range",
        tensors(lambda t: t.update({"model.layers.1.block_sparse_moe.experts.9.w2.weight": torch.zeros(64, 32)})),
        {},
        CheckpointError,
        "expert index 9, outside num_experts=8",
    ),
    (
        "expert-in-dense",
        tensors(lambda t: t.update({"model.layers.0.block_sparse_moe.experts.0.w2.weight": torch.zeros(64, 32)})),
        {},
        CheckpointError,
        "layer 0 is a dense layer",
    ),
    ("nan-weight", poison(float("nan")), {}, CheckpointError, "hold NaN or Inf: model.norm.weight"),
    ("inf-weight", poison(float("-inf")), {}, CheckpointError, "check_finite=False"),
    # from_pretrained arguments
    ("remote-id", nothing, {"path": "moonshotai/Kimi-Linear-48B-A3B-Instruct"}, CheckpointError, "never downloads"),
    ("bad-dtype", nothing, {"dtype": "float77"}, ValueError, "dtype must be a torch dtype"),
    ("bad-device-map", nothing, {"device_map": "everywhere"}, ValueError, "device_map must name a device"),
    ("disk-offload", nothing, {"device_map": {"": "disk"}}, ValueError, "device_map[''] must name a device"),
    (
        "unknown-kwarg",
        nothing,
        {"quantization_config": {}},
        TypeError,
        "unsupported arguments: ['quantization_config']",
    ),
]


@pytest.mark.parametrize(
    "edit, kwargs, error, message", [row[1:] for row in LOAD_ROWS], ids=[row[0] for row in LOAD_ROWS]
)
def test_bad_checkpoint_or_argument_is_refused_by_name(tmp_path, monkeypatch, template, edit, kwargs, error, message):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(template, ckpt)
    edit(ckpt)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    before = snapshot(tmp_path, skip=tmp_path / "out")
    kwargs = dict(kwargs)
    with pytest.raises(error) as caught:
        KimiK3ForCausalLM.from_pretrained(kwargs.pop("path", ckpt), **kwargs)
    assert type(caught.value) is error, caught.value
    assert message in str(caught.value)
    assert snapshot(tmp_path, skip=tmp_path / "out") == before


# ---------------------------------------------------------------- saving (item 2)
def other_model_files(out: Path):
    out.mkdir()
    KimiK3ForCausalLM(KimiK3Config(**k3_kwargs())).save_pretrained(out)


def foreign_weights(out: Path):
    out.mkdir()
    save_file({"w": torch.zeros(2)}, out / WEIGHTS)


def foreign_config(out: Path):
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))


def a_file(out: Path):
    out.write_text("not a folder")


SAVE_ROWS = [
    ("different-model", other_model_files, {}, CheckpointError, "holds a different model's files"),
    ("weights-without-config", foreign_weights, {}, CheckpointError, "but no config.json to tell whose"),
    ("foreign-config", foreign_config, {}, CheckpointError, "model_type is 'llama'"),
    ("out-is-a-file", a_file, {}, CheckpointError, "is a file, not a folder"),
    ("pickle-requested", lambda out: None, {"safe_serialization": False}, ValueError, "safetensors only"),
    ("unknown-save-kwarg", lambda out: None, {"push_to_hub": True}, TypeError, "unsupported arguments: ['push_to_hub"),
    ("bad-shard-size", lambda out: None, {"max_shard_size": "lots"}, ValueError, "lots"),
]


@pytest.mark.parametrize(
    "prepare, kwargs, error, message", [row[1:] for row in SAVE_ROWS], ids=[row[0] for row in SAVE_ROWS]
)
def test_bad_save_is_refused_and_touches_nothing(tmp_path, monkeypatch, prepare, kwargs, error, message):
    out = tmp_path / "out"
    prepare(out)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    (tmp_path / "model_best.safetensors").write_bytes(b"a user's file beside the output folder")
    before = snapshot(tmp_path, skip=out)
    inside = snapshot(out, skip=None) if out.is_dir() else None
    model = KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs()))
    with pytest.raises(error) as caught:
        model.save_pretrained(out, **kwargs)
    assert type(caught.value) is error, caught.value
    assert message in str(caught.value)
    assert snapshot(tmp_path, skip=out) == before
    if inside is not None and error is CheckpointError:
        assert snapshot(out, skip=None) == inside  # a refused save leaves the folder as it was


# ---------------------------------------------------------------- requests: CLI, LLM, SamplingParams

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
    ({"max_draft_tokens": 9}, ValueError, "max_draft_tokens must be None or an int in [0, 8]"),
    ({"max_draft_tokens": 2.0}, ValueError, "max_draft_tokens must be None or an int in [0, 8]"),
    ({"max_draft_tokens": 4, "page_size": 4}, ValueError, "tokens within a page of 4), got 4"),
    (
        {"attention_backend": "cudnn"},
        ValueError,
        "attention_backend (or $KIMI_HELIX_ATTENTION_BACKEND) must be None (automatic) or one of",
    ),
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
