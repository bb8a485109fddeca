"""A table of bad inputs to the config, `from_pretrained` and `save_pretrained`: each gives a clear exception of
one type whose message names the field, file or value, and nothing is written or deleted outside the output
folder (the checkpoint folder, the working directory and everything else under the test's tmp dir are compared
byte for byte before and after)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_helix import CheckpointError, ConfigError, KimiK3Config, KimiK3ForCausalLM

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
