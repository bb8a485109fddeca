"""Each rank reads its own slice of the checkpoint (not rank 0's), through `safe_open(...).get_slice` only, and the
result equals slicing the full model in memory."""

import copy

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from kimi_helix.modeling.checkpoint import CheckpointError
from kimi_helix.modeling.model import KimiK3ForCausalLM
from kimi_helix.parallel import Mapping
from kimi_helix.parallel import tp as tp_mod
from kimi_helix.parallel.tp import load_sharded, shard_model

from .harness import parallel_test_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(parallel_test_config()).eval()
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path, max_shard_size="200KB")  # several shard files
    return model, path


def test_rank_reads_its_own_slice(saved, monkeypatch):
    full, path = saved
    reads = []
    real_open = safetensors.safe_open

    class SliceSpy:  # records which tensors' data are read (a shape query reads none)
        def __init__(self, sl, key):
            self.sl, self.key = sl, key

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, index):
            reads.append(self.key)
            return self.sl[index]

    class Spy:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return SliceSpy(self.inner.get_slice(key), key)

        def get_tensor(self, key):
            raise AssertionError(f"whole-tensor read of {key}")

    monkeypatch.setattr(tp_mod, "safe_open", Spy)
    fp = dict(full.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"  # KDA, split over the world
    o = "model.layers.1.self_attn.o_proj.weight"  # MLA o_proj, columns split over the world
    qb = "model.layers.1.self_attn.q_b_proj.weight"  # MLA queries, split over tp only
    experts = "model.layers.1.block_sparse_moe.experts.gate_up_proj"
    for rank in range(4):
        reads.clear()
        m = load_sharded(path, Mapping(tp=2, cp=2, rank=rank))
        p = dict(m.named_parameters())
        assert torch.equal(p[q], fp[q].chunk(4, 0)[rank])
        assert torch.equal(p[o], fp[o].chunk(4, 1)[rank])
        assert torch.equal(p[qb], fp[qb].chunk(2, 0)[rank // 2])
        assert torch.equal(p[experts], fp[experts].chunk(4, 0)[rank])  # experts 3r .. 3r + 2 only
        if rank:
            assert not torch.equal(p[q], fp[q].chunk(4, 0)[0])
        in_memory = dict(shard_model(_copy(full), Mapping(tp=2, cp=2, rank=rank)).named_parameters())
        assert p.keys() == in_memory.keys()
        for name in p:
            assert torch.equal(p[name], in_memory[name]), name
        assert m.model.layers[0].self_attn.num_heads == 3 and m.model.layers[1].self_attn.num_heads == 6
        # Under expert parallelism a rank reads no byte of another rank's experts.
        experts_read = {int(k.split(".experts.")[1].split(".")[0]) for k in reads if ".experts." in k}
        assert experts_read == set(range(3 * rank, 3 * rank + 3))


def _copy(model):
    return copy.deepcopy(model)


def test_missing_tensor_is_named(saved, tmp_path):
    full, _ = saved
    full.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_sharded(tmp_path, Mapping(tp=2, cp=1, rank=1))
