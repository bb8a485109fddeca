"""Tensor parallelism applied to a built model, in one place (gpt-fast style).

`shard_plan` says, for every parameter, along which dim and into how many parts it splits and which part this rank
keeps; everything else follows from it: `shard_model` slices an in-memory model, `load_sharded` reads only this
rank's slices from safetensors (`safe_open(...).get_slice`), and `parallelize` swaps in the modules that talk to
other ranks (vocab-parallel embedding and lm_head, expert-parallel MoE, all-reduces after row-parallel outputs).

Layout (`Mapping.rank = tp_rank * cp + cp_rank`, world = tp * cp):
- MLA: `q_proj`/`q_b_proj` and `kv_b_proj` column-parallel over tp (the cp ranks of a tp group compute the same
  H / tp heads); `kv_a_proj_with_mqa` and the norms replicated (every rank can write any token's latent);
  the output gate `g_proj` and `o_proj` split over the world by head slice `rank` (H / world heads), then all-reduce.
- KDA: heads split over the world: q/k/v/f_b/g projections, convs, `dt_bias`, `A_log`, `b_proj` by head, `o_proj`
  row-parallel, then all-reduce. `f_a_proj`, `g_a_proj` and `o_norm` (per-head) are replicated.
- Dense MLP and shared experts: gate/up column-parallel, down row-parallel; routed experts split by expert (EP)
  over the world; one all-reduce per MoE block. Router replicated.
- Embedding and lm_head split by vocabulary rows over the world; logits are all-gathered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from ..kernels.moe import fused_experts
from ..modeling import checkpoint as ckpt
from ..modeling.kda import KimiDeltaAttention
from ..modeling.mla import MLAttention
from ..modeling.moe import SparseMoE
from .distributed import Communicator
from .mapping import Mapping


@dataclass(frozen=True)
class Shard:
    """Keep part `index` of `parts` equal parts of a parameter along `dim`."""

    dim: int
    index: int
    parts: int

    def bounds(self, size: int) -> tuple[int, int]:
        step = size // self.parts
        return self.index * step, (self.index + 1) * step

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        lo, hi = self.bounds(tensor.shape[self.dim])
        return tensor.narrow(self.dim, lo, hi - lo)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] //= self.parts
        return tuple(out)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MLA_TP = {"self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight"}
_MLA_WORLD = {"self_attn.g_proj.weight": 0, "self_attn.o_proj.weight": 1}
_KDA_WORLD = {
    **{f"self_attn.{n}.weight": 0 for n in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_proj", "g_b_proj", "b_proj")},
    **{f"self_attn.{n}_conv1d.weight": 0 for n in ("q", "k", "v")},
    "self_attn.dt_bias": 0,
    "self_attn.A_log": 2,
    "self_attn.o_proj.weight": 1,
}
_FFN_WORLD = {
    **{f"{p}.{n}.weight": 0 for p in ("mlp", "block_sparse_moe.shared_experts") for n in ("gate_proj", "up_proj")},
    **{f"{p}.down_proj.weight": 1 for p in ("mlp", "block_sparse_moe.shared_experts")},
    "block_sparse_moe.experts.gate_up_proj": 0,  # expert parallelism: whole experts per rank
    "block_sparse_moe.experts.down_proj": 0,
}


def shard_of(name: str, mapping: Mapping, is_mla_layer: list[bool]) -> Shard | None:
    """How in-memory parameter `name` splits on this rank (None: replicated)."""
    world = mapping.repurpose_cp_to_tp()
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Shard(0, world.rank, world.tp)
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if rest in _FFN_WORLD:
        return Shard(_FFN_WORLD[rest], world.rank, world.tp)
    if is_mla_layer[layer]:
        if rest in _MLA_TP:
            return Shard(0, mapping.tp_rank, mapping.tp)
        if rest in _MLA_WORLD:
            return Shard(_MLA_WORLD[rest], world.rank, world.tp)
        return None
    return Shard(_KDA_WORLD[rest], world.rank, world.tp) if rest in _KDA_WORLD else None


def shard_plan(model: nn.Module, mapping: Mapping) -> dict[str, Shard | None]:
    """`shard_of` for every parameter of `model` (a full-size `KimiK3ForCausalLM`)."""
    mla = [model.config.is_mla_layer(i) for i in range(model.config.num_hidden_layers)]
    return {name: shard_of(name, mapping, mla) for name, _ in model.named_parameters(remove_duplicate=False)}


def _set_param(model: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, value)


def _resize_modules(model: nn.Module, mapping: Mapping) -> None:
    """Head counts that follow from the split weights."""
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.num_heads //= mapping.tp
        elif isinstance(module, KimiDeltaAttention):
            module.num_heads //= mapping.world_size


def shard_model(model: nn.Module, mapping: Mapping) -> nn.Module:
    """Slice a full in-memory model down to this rank's shard, in place (no communication)."""
    mapping.validate(model.config)
    with torch.no_grad():
        for name, shard in shard_plan(model, mapping).items():
            if shard is not None:
                param = model.get_parameter(name)
                _set_param(model, name, nn.Parameter(shard.take(param).clone(), requires_grad=False))
    _resize_modules(model, mapping)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _slice_index(shard: Shard | None, shape: tuple[int, ...]) -> tuple[slice, ...]:
    if shard is None:
        return tuple(slice(None) for _ in shape)
    lo, hi = shard.bounds(shape[shard.dim])
    return tuple(slice(lo, hi) if d == shard.dim else slice(None) for d in range(len(shape)))


def load_sharded(path, mapping: Mapping, *, dtype=None, device="cpu", cls=None):
    """Build this rank's shard of a local safetensors checkpoint, reading only its own slices from disk.

    `dtype` as in `from_pretrained` (None or "auto": the checkpoint's).

    Raises `CheckpointError` for a missing, unexpected or wrong-shape tensor, as the single-process loader does.
    """
    from ..modeling.model import KimiK3ForCausalLM

    cls = cls or KimiK3ForCausalLM
    path = ckpt.checkpoint_dir(path)
    config = ckpt.read_config(path)
    mapping.validate(config)
    files = ckpt.shard_files(path)
    dtype = ckpt.resolve_dtype(dtype, files, config)
    with torch.device("meta"):
        model = cls(config)
    full = dict(ckpt.stored_params(model))
    expected = ckpt.expected_disk_shapes(model)
    plan = shard_plan(model, mapping)
    with torch.device("meta"):
        for name, shard in plan.items():
            if shard is not None:
                _set_param(model, name, nn.Parameter(torch.empty(shard.shape(full[name].shape)), requires_grad=False))
    ckpt.materialize(model, dtype, lambda name: torch.device(device), cls._keep_in_fp32_modules_strict)
    local = dict(ckpt.stored_params(model))
    seen: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(file, "pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    target = ckpt.disk_to_memory(key, full)
                    if target is None:
                        if key == "lm_head.weight" and config.tie_word_embeddings:
                            continue
                        raise ckpt.CheckpointError(f"unexpected tensor {key!r} in {file.name}")
                    seen.add(ckpt.canonical_name(key))
                    _load_one(f.get_slice(key), key, target, plan[target.param], full, local)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ckpt.CheckpointError(f"checkpoint {str(path)!r} is missing {len(missing)} tensors: {missing[:8]}")
    _resize_modules(model, mapping)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _load_one(sl, key: str, target, shard: Shard | None, full: dict, local: dict) -> None:
    """Copy this rank's part of one on-disk tensor (a safetensors slice) into its local parameter."""
    dest_full = full[target.param]
    want = dest_full[target.expert] if target.expert is not None else dest_full
    want = want[target.rows] if target.rows is not None else want
    if tuple(sl.get_shape()) != tuple(want.shape):
        raise ckpt.CheckpointError(f"tensor {key!r} has shape {sl.get_shape()}, the model expects {list(want.shape)}")
    dest = local[target.param]
    if target.expert is not None:  # expert parallelism: only this rank's experts are read at all
        lo, hi = shard.bounds(dest_full.shape[0]) if shard is not None else (0, dest_full.shape[0])
        if not lo <= target.expert < hi:
            return
        dest = dest[target.expert - lo]
        dest = dest[target.rows] if target.rows is not None else dest
        dest.copy_(sl[:])
        return
    dest.copy_(sl[_slice_index(shard, tuple(sl.get_shape()))])


# ---------------------------------------------------------------- modules that communicate


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding; ids outside give zeros, and the all-reduce fills them in."""

    def __init__(self, weight: nn.Parameter, lo: int, comm: Communicator):
        super().__init__()
        self.weight, self.lo, self.comm = weight, lo, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[..., None].to(self.weight.dtype)
        return self.comm.all_reduce(out)


class VocabParallelLMHead(nn.Module):
    """Logits of vocabulary rows [lo, hi) on each rank, gathered: [T, d] -> [T, V]."""

    def __init__(self, weight: nn.Parameter, comm: Communicator):
        super().__init__()
        self.weight, self.comm = weight, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(F.linear(hidden, self.weight))


class ExpertParallelExperts(nn.Module):
    """Experts [first, first + E_local) of a routed layer; tokens routed elsewhere contribute zero here."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, first: int):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.first = gate_up_proj, down_proj, first

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, d]; weights, ids [T, k] global expert ids -> this rank's partial sum [T, d]."""
        local = ids - self.first
        mine = (local >= 0) & (local < self.gate_up_proj.shape[0])
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights * mine, torch.where(mine, local, 0))


def _all_reduce_output(comm: Communicator):
    def hook(module, args, output):
        return comm.all_reduce(output)

    return hook


def parallelize(model: nn.Module, comm: Communicator) -> nn.Module:
    """Install the communicating modules and all-reduces on a sharded model (`shard_model` / `load_sharded`)."""
    mapping = comm.mapping.repurpose_cp_to_tp()
    if mapping.world_size == 1:
        return model
    inner = model.model
    vocab_lo = mapping.rank * model.config.vocab_size // mapping.world_size
    inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens.weight, vocab_lo, comm)
    model.lm_head = VocabParallelLMHead(model.lm_head.weight, comm)
    for layer in inner.layers:
        layer.self_attn.o_proj.register_forward_hook(_all_reduce_output(comm))
        ffn = layer.ffn
        if isinstance(ffn, SparseMoE):
            e_local = ffn.experts.gate_up_proj.shape[0]
            ffn.experts = ExpertParallelExperts(ffn.experts.gate_up_proj, ffn.experts.down_proj, mapping.rank * e_local)
        ffn.register_forward_hook(_all_reduce_output(comm))
    return model
