"""What a Hugging Face user expects of loading: AutoModel gives the base model, device_map places the layers
through accelerate, a progress bar over the shards, and the package's submodules usable after `import kimi_helix`."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModel

from kimi_helix import CheckpointError, KimiK3Config, KimiK3ForCausalLM, KimiK3Model

from .conftest import tiny_kwargs


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs())).eval()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    return model, tmp_path


def test_auto_model_loads_the_base_model_and_skips_lm_head(checkpoint):
    full, path = checkpoint
    base = AutoModel.from_pretrained(path)
    assert type(base).__name__ == "KimiK3Model" and not hasattr(base, "lm_head")
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert torch.equal(base(ids).last_hidden_state, full.model(ids).last_hidden_state)


def test_base_model_checkpoint_round_trips_and_lacks_a_head(checkpoint, tmp_path_factory):
    full, path = checkpoint
    out = tmp_path_factory.mktemp("base")
    KimiK3Model.from_pretrained(path).save_pretrained(out)
    again = KimiK3Model.from_pretrained(out)
    assert torch.equal(again.embed_tokens.weight, full.model.embed_tokens.weight)
    with pytest.raises(CheckpointError, match=r"missing 1 tensors: lm_head\.weight"):
        KimiK3ForCausalLM.from_pretrained(out)


@pytest.mark.parametrize(
    "device_map", ["auto", "balanced", "sequential", {"": "cpu"}, {"model": "cpu", "lm_head": "cpu"}]
)
def test_device_map_on_a_cpu_only_machine_puts_everything_on_cpu(checkpoint, device_map, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    full, path = checkpoint
    model = KimiK3ForCausalLM.from_pretrained(path, device_map=device_map)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert set(model.hf_device_map.values()) == {"cpu"}
    ids = torch.randint(3, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, full(ids).logits)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(device_map={"model": "cpu"}), r"device_map places no module that holds parameter 'lm_head\.weight'"),
        (dict(device_map={"": "disk"}), r"device_map\[''\] must name a device"),
        (dict(device_map="everywhere"), r"device_map must name a device .*got 'everywhere'"),
        (dict(device="cpu", device_map="auto"), r"pass device or device_map, not both"),
    ],
)
def test_bad_device_maps_are_named(checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KimiK3ForCausalLM.from_pretrained(checkpoint[1], **kwargs)


def test_progress_bar_over_shards_is_configurable(checkpoint, capsys):
    KimiK3ForCausalLM.from_pretrained(checkpoint[1], progress_bar=True)
    assert "Loading checkpoint shards" in capsys.readouterr().err
    KimiK3ForCausalLM.from_pretrained(checkpoint[1])  # stderr is not a terminal here: no bar by default
    KimiK3ForCausalLM.from_pretrained(checkpoint[1], progress_bar=False)
    assert "Loading checkpoint shards" not in capsys.readouterr().err


@pytest.mark.gpu
def test_device_map_auto_spreads_layers_over_two_gpus_and_matches_one(checkpoint):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    full, path = checkpoint
    layers = {f"model.layers.{i}": i % 2 for i in range(4)}
    device_map = {"model.embed_tokens": 0, **layers, "model.norm": 1, "lm_head": 1}
    model = KimiK3ForCausalLM.from_pretrained(path, device_map=device_map)
    assert {p.device.index for p in model.parameters()} == {0, 1}
    ids = torch.randint(3, 128, (2, 33))
    with torch.no_grad():
        expected = full.cuda(0)(ids.cuda(0)).logits
        assert torch.allclose(model(ids.cuda(0)).logits.to(expected.device), expected, rtol=1e-4, atol=1e-4)


def test_submodules_work_after_a_bare_import_without_loading_torch():
    code = (
        "import sys, kimi_helix\n"
        "assert 'torch' not in sys.modules, 'import kimi_helix loaded torch'\n"
        "print(kimi_helix.presets.get_preset('tiny').num_hidden_layers)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4"
