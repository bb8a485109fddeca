"""Checkpoint I/O: sharded safetensors in the Kimi-Linear tensor layout, and nothing else.

On disk, routed experts are stored per expert as Moonshot does (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`);
in memory they are stacked (`experts.gate_up_proj` [E, 2I, d], `experts.down_proj` [E, d, I]) so grouped kernels
read them in place. Everything else has the same name in both. Loading streams tensor by tensor into a model built
on the meta device, and any missing, unexpected or wrong-shape tensor raises `CheckpointError` naming it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .config import KimiK3Config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_linear")

_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
# transformers' native KimiLinear saves layer 0's dense MLP under `block_sparse_moe.`; Moonshot uses `mlp.`.
_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


# Hub and loader options that mean nothing for a local safetensors directory (AutoModel passes several); remote
# code is never run, whatever `trust_remote_code` says.
_IGNORED_LOAD_KWARGS = (
    "revision",
    "adapter_kwargs",
    "cache_dir",
    "force_download",
    "proxies",
    "token",
    "code_revision",
    "_from_auto",
    "_commit_hash",
    "local_files_only",
    "low_cpu_mem_usage",
    "use_safetensors",
    "trust_remote_code",
    "attn_implementation",
)


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config describes."""


@dataclass(frozen=True)
class Target:
    """Where one on-disk tensor lands in memory: `param[expert][rows]` (whole param when expert is None)."""

    param: str
    expert: int | None = None
    rows: slice | None = None


def disk_to_memory(key: str, params: dict[str, nn.Parameter]) -> Target | None:
    """Map an on-disk tensor name to its in-memory target; None if the model has no such tensor."""
    m = _EXPERT.match(key)
    if m:
        prefix, expert, w = m.group(1), int(m.group(2)), m.group(3)
        if w == "w2":
            return Target(f"{prefix}.down_proj", expert)
        name = f"{prefix}.gate_up_proj"
        if name not in params:
            return None
        inter = params[name].shape[1] // 2
        return Target(name, expert, slice(0, inter) if w == "w1" else slice(inter, 2 * inter))
    m = _DENSE_ALIAS.match(key)
    if m and key not in params:
        key = f"{m.group(1)}.mlp.{m.group(2)}.weight"
    return Target(key) if key in params else None


def memory_to_disk(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The on-disk state dict of an in-memory one (experts unstacked into per-expert w1/w3/w2)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = tensor[e, :inter].contiguous()
                out[f"{prefix}.{e}.w3.weight"] = tensor[e, inter:].contiguous()
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.w2.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


def expected_disk_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor a complete checkpoint of `model` holds on disk, with its shape (tied lm_head excluded)."""
    metas = {name: torch.empty(p.shape, device="meta") for name, p in _own_params(model).items()}
    return {k: tuple(v.shape) for k, v in memory_to_disk(metas).items()}


def _own_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Named parameters that a checkpoint stores: a tied lm_head is the embedding, so it is left out."""
    params = dict(model.named_parameters(remove_duplicate=True))
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    return params


def _resolve_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a local directory; kimi_helix loads only local checkpoints and never downloads"
        )
    return path


def _shard_files(path: Path) -> list[Path]:
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" (found {found}: pickle-based formats are never loaded; convert them to safetensors)" if found else ""
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r}{hint}")


def _resolve_dtype(dtype, files: list[Path], config: KimiK3Config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, torch.dtype):
            return saved
        if isinstance(saved, str) and isinstance(getattr(torch, saved, None), torch.dtype):
            return getattr(torch, saved)
        with safe_open(files[0], "pt") as f:
            first = next(iter(f.keys()), None)
            return _SAFETENSORS_DTYPES.get(f.get_slice(first).get_dtype(), torch.float32) if first else torch.float32
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype must be a torch dtype, its name (e.g. 'bfloat16') or 'auto', got {dtype!r}")


def _read_config(path: Path) -> KimiK3Config:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {str(path)!r}")
    raw = json.loads(config_file.read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"config.json model_type is {model_type!r}; kimi_helix loads {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    raw.pop("model_type")
    return KimiK3Config.from_dict(raw)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device, keep_fp32: list[str]) -> None:
    """Replace meta parameters by uninitialised storage of the target dtype (fp32 for `keep_fp32` names)."""
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            full = f"{module_name}.{name}" if module_name else name
            want = torch.float32 if any(k in full for k in keep_fp32) else dtype
            module._parameters[name] = nn.Parameter(
                torch.empty(param.shape, dtype=want, device=device), requires_grad=param.requires_grad
            )


def load_pretrained(
    cls, path, *, config=None, dtype=None, torch_dtype=None, device=None, device_map=None, **kwargs
) -> nn.Module:
    """Build `cls` from a local checkpoint directory; see `KimiK3PreTrainedModel.from_pretrained`."""
    subfolder = kwargs.pop("subfolder", "") or ""
    for name in _IGNORED_LOAD_KWARGS:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"{cls.__name__}.from_pretrained got unsupported arguments: {sorted(kwargs)}")
    path = _resolve_dir(Path(path) / subfolder)
    if not isinstance(config, KimiK3Config):
        config = _read_config(path)  # also when given transformers' own KimiLinearConfig
    files = _shard_files(path)
    dtype = _resolve_dtype(dtype if dtype is not None else torch_dtype, files, config)
    device = torch.device(device if device is not None else (device_map if isinstance(device_map, str) else "cpu"))
    if device_map is not None and not isinstance(device_map, (str, torch.device)):
        raise ValueError(f"device_map must name a single device (e.g. 'cuda:0'), got {device_map!r}")
    if device.type == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    with torch.device("meta"):
        model = cls(config)
    _materialize(model, dtype, device, cls._keep_in_fp32_modules_strict)
    params = _own_params(model)
    expected = expected_disk_shapes(model)
    seen: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(file, "pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    target = disk_to_memory(key, params)
                    if target is None:
                        if key == "lm_head.weight" and config.tie_word_embeddings:
                            continue
                        raise CheckpointError(f"unexpected tensor {key!r} in {file.name}: the model has no such tensor")
                    dest = params[target.param]
                    if target.expert is not None:
                        dest = dest[target.expert]
                    if target.rows is not None:
                        dest = dest[target.rows]
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != tuple(dest.shape):
                        raise CheckpointError(
                            f"tensor {key!r} in {file.name} has shape {list(shape)}, the model expects "
                            f"{list(dest.shape)}"
                        )
                    dest.copy_(f.get_tensor(key))
                    seen.add(_canonical(key))
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(f"{k} {list(expected[k])}" for k in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint {str(path)!r} is missing {len(missing)} tensors: {shown}{more}")
    model.tie_weights()
    model.eval()
    return model


def _canonical(key: str) -> str:
    m = _DENSE_ALIAS.match(key)
    return f"{m.group(1)}.mlp.{m.group(2)}.weight" if m else key


def save_pretrained(model: nn.Module, save_directory, max_shard_size: int | str = "5GB", **kwargs) -> None:
    """Write `model` as config.json + generation_config.json + (sharded) safetensors; see module docstring."""
    if kwargs.pop("safe_serialization", True) is False:
        raise ValueError("kimi_helix saves safetensors only (safe_serialization=False is not supported)")
    kwargs.pop("is_main_process", None)
    if kwargs:
        raise TypeError(f"save_pretrained got unsupported arguments: {sorted(kwargs)}")
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # never leave shards of an older save beside the new ones
    model.config.dtype = model.dtype
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    state = memory_to_disk({k: v.detach() for k, v in _own_params(model).items()})
    split = split_torch_state_dict_into_shards(
        state, max_shard_size=max_shard_size, filename_pattern="model{suffix}.safetensors"
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n].cpu() for n in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": split.tensor_to_filename,
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
