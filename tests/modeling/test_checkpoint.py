"""Checkpoint I/O: sharded safetensors round trip, and errors that name the bad tensor."""

import json

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
