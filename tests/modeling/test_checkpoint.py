"""Checkpoint I/O: sharded safetensors round trip, and errors that name the bad tensor."""

import json
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_helix import CheckpointError, KimiK3Config, KimiK3ForCausalLM

from .conftest import k3_kwargs, tiny_kwargs


def saved_model(tmp_path, **overrides):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs(**overrides))).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize(
    "kwargs",
    [tiny_kwargs(), k3_kwargs(), tiny_kwargs(tie_word_embeddings=True)],
    ids=["kimi-linear", "k3-style", "tied"],
)
def test_sharded_round_trip_is_exact(tmp_path, kwargs):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    # Experts are stored per expert, with Moonshot's names.
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in index["weight_map"]
    loaded = KimiK3ForCausalLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_bf16_load_keeps_router_and_gate_parameters_fp32(tmp_path):
    saved_model(tmp_path)
    model = KimiK3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["model.layers.1.block_sparse_moe.gate.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.dt_bias"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16


def rewrite(tmp_path, edit):
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    saved_model(tmp_path)
    rewrite(tmp_path, lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensors: model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_missing_expert_is_named(tmp_path):
    saved_model(tmp_path)
    rewrite(tmp_path, lambda t: t.pop("model.layers.3.block_sparse_moe.experts.5.w2.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.5\.w2\.weight \[64, 32\]"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    saved_model(tmp_path)
    rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.surprise": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.surprise'"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    saved_model(tmp_path)
    rewrite(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*shape \[65\], the model expects \[64\]"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_pickle_checkpoints_and_remote_dirs_are_refused(tmp_path):
    saved_model(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle-based formats are never loaded"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="never downloads"):
        KimiK3ForCausalLM.from_pretrained("moonshotai/Kimi-Linear-48B-A3B-Instruct")


def test_unknown_model_type_is_refused(tmp_path):
    saved_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type is 'llama'"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------- saving deletes only what it wrote
def test_save_deletes_only_its_own_stale_shards(tmp_path):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs())).eval()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-0*-of-*.safetensors"))) > 1
    keep = ["model_best.safetensors", "model-v2-finetune.safetensors", "model.safetensors.backup", "notes.txt"]
    for name in keep:
        (tmp_path / name).write_bytes(b"the user's " + name.encode())
    model.save_pretrained(tmp_path)  # one file now: the old shards and index are stale
    assert (
        not list(tmp_path.glob("model-0*-of-*.safetensors"))
        and not (tmp_path / "model.safetensors.index.json").exists()
    )
    for name in keep:
        assert (tmp_path / name).read_bytes() == b"the user's " + name.encode()
    KimiK3ForCausalLM.from_pretrained(tmp_path)


def folder_bytes(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_save_refuses_a_different_models_folder_unless_overwrite(tmp_path):
    saved_model(tmp_path)
    before = folder_bytes(tmp_path)
    other = KimiK3ForCausalLM(KimiK3Config(**k3_kwargs())).eval()
    with pytest.raises(CheckpointError, match=r"holds a different model's files .*config\.json.*overwrite=True"):
        other.save_pretrained(tmp_path)
    assert folder_bytes(tmp_path) == before
    other.save_pretrained(tmp_path, overwrite=True)
    assert KimiK3ForCausalLM.from_pretrained(tmp_path).config.q_lora_rank == 24


def test_save_refuses_weights_it_cannot_attribute(tmp_path):
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    before = folder_bytes(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds \['model\.safetensors'\] but no config\.json"):
        KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs())).save_pretrained(tmp_path)
    assert folder_bytes(tmp_path) == before


def test_save_over_the_same_architecture_replaces_it(tmp_path):
    saved_model(tmp_path)
    torch.manual_seed(1)
    retrained = KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs())).eval()
    retrained.save_pretrained(tmp_path)
    loaded = KimiK3ForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, retrained.lm_head.weight)


# ---------------------------------------------------------------- the loader trusts nothing in the folder
def sharded(tmp_path):
    saved = KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs())).eval()
    saved.save_pretrained(tmp_path, max_shard_size="20KB")
    return json.loads((tmp_path / "model.safetensors.index.json").read_text())


def write_index(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors"])
def test_index_shard_outside_the_folder_is_refused(tmp_path, shard):
    index = sharded(tmp_path)
    index["weight_map"]["model.norm.weight"] = shard
    write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=rf"maps 'model\.norm\.weight' to '{re.escape(shard)}'.*inside"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_fifo_shard_is_refused_without_blocking(tmp_path):
    index = sharded(tmp_path)
    os.mkfifo(tmp_path / "pipe.safetensors")
    index["weight_map"]["model.norm.weight"] = "pipe.safetensors"
    write_index(tmp_path, index)

    def hang(signum, frame):
        raise TimeoutError("the loader opened the FIFO")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    try:
        with pytest.raises(CheckpointError, match=r"pipe\.safetensors' is not a regular file"):
            KimiK3ForCausalLM.from_pretrained(tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_tensor_in_two_shards_is_an_error(tmp_path):
    index = sharded(tmp_path)
    shards = sorted(set(index["weight_map"].values()))
    first = load_file(tmp_path / shards[0])
    last = load_file(tmp_path / shards[-1])
    name = next(iter(first))
    save_file({**last, name: first[name]}, tmp_path / shards[-1], metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=rf"'{re.escape(name)}' appears twice: in {shards[0]} and in {shards[-1]}"
    ):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int64])
def test_non_float_tensor_for_a_float_parameter_is_an_error(tmp_path, dtype):
    saved_model(tmp_path)
    rewrite(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=dtype)}))
    with pytest.raises(
        CheckpointError, match=r"'model\.norm\.weight' in model\.safetensors is (I32|BOOL|I64); a float"
    ):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "index, message",
    [
        ("{not json", r"index .*model\.safetensors\.index\.json' is not valid JSON"),
        ('{"metadata": {}}', "has no weight_map"),
        ("[]", "has no weight_map"),
    ],
    ids=["bad-json", "no-weight-map", "list"],
)
def test_bad_index_names_the_file(tmp_path, index, message):
    sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=message):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_missing_shard_names_the_file(tmp_path):
    index = sharded(tmp_path)
    gone = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / gone).unlink()
    with pytest.raises(CheckpointError, match=rf"shard '.*{gone}' does not exist"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_truncated_or_corrupt_safetensors_names_the_file(tmp_path, damage):
    saved_model(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncate": data[:-1000], "garbage": b"\x00\x01garbage" * 50, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is not a readable safetensors file"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_expert_index_outside_num_experts_is_named(tmp_path):
    saved_model(tmp_path)
    extra = "model.layers.1.block_sparse_moe.experts.8.w2.weight"
    rewrite(tmp_path, lambda t: t.update({extra: torch.zeros(64, 32)}))
    with pytest.raises(CheckpointError, match=r"experts\.8\.w2\.weight' .* expert index 8, outside num_experts=8"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


def test_expert_tensor_in_a_dense_layer_is_named(tmp_path):
    saved_model(tmp_path)
    extra = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    rewrite(tmp_path, lambda t: t.update({extra: torch.zeros(32, 64)}))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight' .* layer 0 is a dense layer"):
        KimiK3ForCausalLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------- NaN / Inf guard
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_reported_unless_disabled(tmp_path, bad):
    saved_model(tmp_path)

    def poison(t):
        t["model.layers.2.self_attn.o_proj.weight"][3, 5] = bad

    rewrite(tmp_path, poison)
    with pytest.raises(
        CheckpointError, match=r"1 tensors hold NaN or Inf: model\.layers\.2\.self_attn\.o_proj\.weight"
    ):
        KimiK3ForCausalLM.from_pretrained(tmp_path)
    model = KimiK3ForCausalLM.from_pretrained(tmp_path, check_finite=False)
    assert not torch.isfinite(model.model.layers[2].self_attn.o_proj.weight).all()
