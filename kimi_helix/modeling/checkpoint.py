"""Checkpoint I/O: sharded safetensors in the Kimi-Linear tensor layout, and nothing else.

On disk, routed experts are stored per expert as Moonshot does (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`);
in memory they are stacked (`experts.gate_up_proj` [E, 2I, d], `experts.down_proj` [E, d, I]) so grouped kernels
read them in place. Everything else has the same name in both. Loading streams tensor by tensor into a model built
on the meta device.

Nothing in the folder is trusted (see docs/reliability.md): the index may name only regular files inside the
folder, every tensor must appear once, be a float tensor of the right shape and finite, and any missing,
unexpected, duplicated or unreadable tensor raises `CheckpointError` naming it and its file. Saving deletes only
files of our own naming pattern and refuses to replace another model's files unless `overwrite=True`.
"""

from __future__ import annotations

import json
import os
import re
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from huggingface_hub import save_torch_state_dict
from huggingface_hub.utils import tqdm
from safetensors import SafetensorError, safe_open
from torch import nn

from .config import ConfigError, KimiK3Config
from .placement import dispatch, param_devices

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_linear")

# The weight files `save_pretrained` writes, and so the only ones it ever deletes.
OWN_WEIGHT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")

_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.block_sparse_moe\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
# transformers' native KimiLinear saves layer 0's dense MLP under `block_sparse_moe.`; Moonshot uses `mlp.`.
_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$")

# Float dtypes a parameter may be loaded from (cast to the model dtype); ints, bools and fp8 (which would need
# scales) are refused.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MAX_NAMED = 8  # tensors named in one error message

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
    """A checkpoint folder or file that cannot be loaded as the model its config describes (or saved over)."""


@dataclass(frozen=True)
class Target:
    """Where one on-disk tensor lands in memory: `param[expert][rows]` (whole param when expert is None)."""

    param: str
    expert: int | None = None
    rows: slice | None = None


def disk_to_memory(key: str, params: dict[str, nn.Parameter], where: str = "the checkpoint") -> Target | None:
    """Map an on-disk tensor name to its in-memory target; None if the model has no such tensor.

    Raises `CheckpointError` for an expert tensor of a dense layer or an expert index outside `num_experts`.
    """
    m = _EXPERT.match(key)
    if m:
        prefix, layer, expert, w = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        down = f"{prefix}.down_proj"
        if down not in params:
            if f"model.layers.{layer}.mlp.down_proj.weight" in params:
                raise CheckpointError(
                    f"expert tensor {key!r} in {where}, but layer {layer} is a dense layer (mlp_layer_types[{layer}]"
                    f" is 'dense': see first_k_dense_replace / moe_layer_freq)"
                )
            return None
        num_experts = params[down].shape[0]
        if expert >= num_experts:
            raise CheckpointError(
                f"expert tensor {key!r} in {where} has expert index {expert}, outside num_experts={num_experts} "
                f"(0..{num_experts - 1})"
            )
        if w == "w2":
            return Target(down, expert)
        name = f"{prefix}.gate_up_proj"
        inter = params[name].shape[1] // 2
        return Target(name, expert, slice(0, inter) if w == "w1" else slice(inter, 2 * inter))
    m = _DENSE_ALIAS.match(key)
    if m and key not in params:
        key = f"{m.group(1)}.mlp.{m.group(2)}.weight"
    return Target(key) if key in params else None


def memory_to_disk(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The on-disk state dict of an in-memory one (experts unstacked into per-expert w1/w3/w2, each a copy:
    safetensors refuses to save a view of a larger storage)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = tensor[e, :inter].clone()
                out[f"{prefix}.{e}.w3.weight"] = tensor[e, inter:].clone()
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.w2.weight"] = tensor[e].clone()
        else:
            out[name] = tensor.contiguous()
    return out


def expected_disk_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor a complete checkpoint of `model` holds on disk, with its shape (tied lm_head excluded)."""
    metas = {name: torch.empty(p.shape, device="meta") for name, p in stored_params(model).items()}
    return {k: tuple(v.shape) for k, v in memory_to_disk(metas).items()}


def stored_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Named parameters that a checkpoint stores: a tied lm_head is the embedding, so it is left out."""
    params = dict(model.named_parameters(remove_duplicate=True))
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    return params


def _base_prefix(model: nn.Module) -> str:
    """'' for a model with its base under `model.` (the causal LM), 'model.' for the base model itself.

    Tensors are matched in the causal LM's namespace, as transformers does: a base model loads a causal-LM
    checkpoint and skips `lm_head`, and a base-model checkpoint (names without `model.`) loads into either.
    """
    return "" if hasattr(model, model.base_model_prefix) else f"{model.base_model_prefix}."


# ---------------------------------------------------------------- the folder's files
def checkpoint_dir(path: str | os.PathLike) -> Path:
    """`path` as a `Path` if it is a local directory; else `CheckpointError` (nothing is ever downloaded)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a local directory; kimi_helix loads only local checkpoints and never downloads"
        )
    return path


def _regular_file(path: Path, what: str) -> Path:
    """`path` if it is a regular file (symlinks followed, as in the Hub cache); a FIFO or device would block."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise CheckpointError(f"{what} {str(path)!r} does not exist or cannot be read: {err.strerror}") from err
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{what} {str(path)!r} is not a regular file; refusing to read it")
    return path


def _read_json(path: Path, what: str):
    try:
        return json.loads(_regular_file(path, what).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{what} {str(path)!r} is not valid JSON: {err}") from err


def _index_shards(path: Path) -> list[Path]:
    """The shards `model.safetensors.index.json` names, each a plain relative name inside `path`."""
    index = _read_json(path / INDEX_FILE, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"index {str(path / INDEX_FILE)!r} has no weight_map (tensor name -> shard file)")
    shards = set()
    for tensor, shard in weight_map.items():
        rel = PurePosixPath(shard) if isinstance(shard, str) else None
        if rel is None or rel.is_absolute() or ".." in rel.parts or "\\" in shard or not rel.parts:
            raise CheckpointError(
                f"index {str(path / INDEX_FILE)!r} maps {tensor!r} to {shard!r}; shard names must be relative "
                f"file names inside the checkpoint folder"
            )
        shards.add(shard)
    return [_regular_file(path / shard, "shard") for shard in sorted(shards)]


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of checkpoint folder `path`, in load order: the shards its index names (each checked
    to be a regular file inside the folder), else `model.safetensors`. Pickle formats raise `CheckpointError`."""
    if (path / INDEX_FILE).exists():
        return _index_shards(path)
    if (path / SINGLE_FILE).exists():
        return [_regular_file(path / SINGLE_FILE, "weights file")]
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" (found {found}: pickle-based formats are never loaded; convert them to safetensors)" if found else ""
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r}{hint}")


# Shapes a checkpoint's config.json must state (transformers writes every model-specific field).
REQUIRED_CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config(path: Path) -> KimiK3Config:
    """The validated `KimiK3Config` of `path/config.json` (`kimi_k3` or Kimi-Linear's `kimi_linear`)."""
    config_file = path / CONFIG_FILE
    if not config_file.exists():
        raise CheckpointError(f"no config.json in {str(path)!r}")
    raw = _read_json(config_file, "config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{str(config_file)!r} must hold a JSON object of config fields, got a {type(raw).__name__}")
    model_type = raw.pop("model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"config.json model_type is {model_type!r}; kimi_helix loads {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    missing = [name for name in REQUIRED_CONFIG_FIELDS if name not in raw]
    if missing:  # a default would silently describe another model (the 48B one)
        raise ConfigError(f"{str(config_file)!r} lacks {', '.join(missing)}: a checkpoint's config names its shapes")
    try:
        return KimiK3Config.from_dict(raw)
    except ConfigError as err:
        raise ConfigError(f"{str(config_file)!r}: {err}") from err


def resolve_dtype(dtype, files: list[Path], config: KimiK3Config) -> torch.dtype:
    """The parameter dtype of a load: `dtype` itself (a torch dtype or its name), or for None / "auto" the config's
    saved `dtype`, else the first tensor's dtype in `files[0]`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, torch.dtype):
            return saved
        if saved is not None:
            if isinstance(saved, str) and isinstance(getattr(torch, saved, None), torch.dtype):
                return getattr(torch, saved)
            raise ConfigError(f"KimiK3Config.dtype must name a torch dtype (e.g. 'bfloat16'), got {saved!r}")
        with _open(files[0]) as f:
            first = next(iter(f.keys()), None)
            return _SAFETENSORS_DTYPES.get(f.get_slice(first).get_dtype(), torch.float32) if first else torch.float32
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype must be a torch dtype, its name (e.g. 'bfloat16') or 'auto', got {dtype!r}")


@contextmanager
def _open(file: Path):
    """`safe_open` whose header errors (truncated, corrupt, not safetensors) name the file."""
    try:
        handle = safe_open(file, "pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{str(file)!r} is not a readable safetensors file: {err}") from err
    with handle as f:
        yield f


# ---------------------------------------------------------------- loading
def materialize(model: nn.Module, dtype: torch.dtype, devices, keep_fp32: list[str]) -> None:
    """Replace meta parameters by uninitialised storage of the target dtype (fp32 for `keep_fp32` names) on the
    device `devices(name)` gives."""
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            full = f"{module_name}.{name}" if module_name else name
            want = torch.float32 if any(k in full for k in keep_fp32) else dtype
            module._parameters[name] = nn.Parameter(
                torch.empty(param.shape, dtype=want, device=devices(full)), requires_grad=param.requires_grad
            )


def load_pretrained(
    cls,
    path,
    *,
    config=None,
    dtype=None,
    torch_dtype=None,
    device=None,
    device_map=None,
    max_memory=None,
    check_finite: bool = True,
    progress_bar: bool | None = None,
    **kwargs,
) -> nn.Module:
    """Build `cls` from a local checkpoint directory; see `KimiK3PreTrainedModel.from_pretrained`."""
    subfolder = kwargs.pop("subfolder", "") or ""
    for name in _IGNORED_LOAD_KWARGS:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"{cls.__name__}.from_pretrained got unsupported arguments: {sorted(kwargs)}")
    path = checkpoint_dir(Path(path) / subfolder)
    if not isinstance(config, KimiK3Config):
        config = read_config(path)  # also when given transformers' own KimiLinearConfig
    files = shard_files(path)
    dtype = resolve_dtype(dtype if dtype is not None else torch_dtype, files, config)

    with torch.device("meta"):
        model = cls(config)
    devices, device_map = param_devices(model, device, device_map, dtype, max_memory)
    materialize(model, dtype, devices, cls._keep_in_fp32_modules_strict)
    prefix = _base_prefix(model)
    params = {prefix + k: v for k, v in stored_params(model).items()}
    expected = {prefix + k: v for k, v in expected_disk_shapes(model).items()}
    seen = _load_shards(files, params, check_finite, progress_bar)
    missing = sorted(set(expected) - set(seen))
    if missing:
        shown = ", ".join(f"{k} {list(expected[k])}" for k in missing[:_MAX_NAMED])
        more = f" and {len(missing) - _MAX_NAMED} more" if len(missing) > _MAX_NAMED else ""
        raise CheckpointError(f"checkpoint {str(path)!r} is missing {len(missing)} tensors: {shown}{more}")
    model.tie_weights()
    dispatch(model, device_map)
    model.name_or_path = model.config._name_or_path = str(path)  # where `LLM(model)` finds the tokenizer
    model.eval()
    return model


def _load_shards(files, params, check_finite: bool, progress_bar: bool | None) -> dict[str, str]:
    """Copy every tensor of `files` into `params`; returns canonical tensor name -> the file that held it.

    Names are matched in the causal LM's namespace: a base-model checkpoint's names gain the `model.` prefix.
    """
    seen: dict[str, str] = {}
    not_finite: list[str] = []
    bar = tqdm(
        files,
        desc="Loading checkpoint shards",
        unit="shard",
        disable=None if progress_bar is None else not progress_bar,
    )
    with torch.no_grad():
        for file in bar:
            with _open(file) as f:
                for disk_key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    key = (
                        disk_key
                        if disk_key.startswith("model.") or disk_key == "lm_head.weight"
                        else f"model.{disk_key}"
                    )
                    where = file.name
                    target = disk_to_memory(key, params, where)
                    if target is None:
                        if key == "lm_head.weight":
                            continue  # a tied head is the embedding; a base model has no head
                        raise CheckpointError(
                            f"unexpected tensor {disk_key!r} in {where}: the model has no such tensor"
                        )
                    canonical = canonical_name(key)
                    if canonical in seen:
                        raise CheckpointError(f"tensor {disk_key!r} appears twice: in {seen[canonical]} and in {where}")
                    seen[canonical] = where
                    _copy_tensor(f, disk_key, _dest(params, target), where)
                    if check_finite and not torch.isfinite(_dest(params, target)).all():
                        not_finite.append(f"{disk_key} ({where})")
    if not_finite:
        shown = ", ".join(not_finite[:_MAX_NAMED]) + (" ..." if len(not_finite) > _MAX_NAMED else "")
        raise CheckpointError(
            f"{len(not_finite)} tensors hold NaN or Inf: {shown} (pass check_finite=False to load them anyway)"
        )
    return seen


def _dest(params: dict[str, nn.Parameter], target: Target) -> torch.Tensor:
    dest = params[target.param]
    if target.expert is not None:
        dest = dest[target.expert]
    return dest if target.rows is None else dest[target.rows]


def _copy_tensor(f, key: str, dest: torch.Tensor, where: str) -> None:
    """Check the on-disk dtype and shape of `key`, then copy it into `dest` (cast to dest's dtype)."""
    try:
        sliced = f.get_slice(key)
        disk_dtype, shape = sliced.get_dtype(), tuple(sliced.get_shape())
    except SafetensorError as err:
        raise CheckpointError(f"tensor {key!r} in {where} cannot be read: {err}") from err
    if disk_dtype not in _SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"tensor {key!r} in {where} is {disk_dtype}; a float parameter loads only from "
            f"{', '.join(_SAFETENSORS_DTYPES)}"
        )
    if shape != tuple(dest.shape):
        raise CheckpointError(
            f"tensor {key!r} in {where} has shape {list(shape)}, the model expects {list(dest.shape)}"
        )
    try:
        dest.copy_(f.get_tensor(key))
    except SafetensorError as err:
        raise CheckpointError(f"tensor {key!r} in {where} cannot be read: {err}") from err


def canonical_name(key: str) -> str:
    """One name per tensor: transformers' `block_sparse_moe.{gate,up,down}_proj` alias of a dense MLP -> `mlp.`."""
    m = _DENSE_ALIAS.match(key)
    return f"{m.group(1)}.mlp.{m.group(2)}.weight" if m else key


# ---------------------------------------------------------------- saving
def save_pretrained(
    model: nn.Module, save_directory, max_shard_size: int | str = "5GB", *, overwrite: bool = False, **kwargs
) -> None:
    """Write `model` as config.json + generation_config.json + (sharded) safetensors; see module docstring.

    Only files of our own naming pattern (`OWN_WEIGHT_FILES`) are deleted, as stale shards of an older save.
    A folder that already holds config.json, generation_config.json or such weights of a *different model* (one
    whose tensors, names and shapes, differ from `model`'s; or an unreadable config; or weights with no config) is
    refused with `CheckpointError` unless `overwrite=True`. Other files are never touched.
    """
    if kwargs.pop("safe_serialization", True) is False:
        raise ValueError("kimi_helix saves safetensors only (safe_serialization=False is not supported)")
    if kwargs.pop("is_main_process", True) is False:
        return  # distributed saving: only the main process writes
    if kwargs:
        raise TypeError(f"save_pretrained got unsupported arguments: {sorted(kwargs)}")
    out = Path(save_directory)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"save_pretrained: {str(out)!r} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    if not overwrite:
        _refuse_other_model(model, out)
    for stale in out.iterdir():
        if OWN_WEIGHT_FILES.fullmatch(stale.name) and (stale.is_file() or stale.is_symlink()):
            stale.unlink()  # never leave shards of an older save beside the new ones
    model.config.dtype = model.dtype
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    state = memory_to_disk({k: v.detach().cpu() for k, v in stored_params(model).items()})
    # is_main_process=False: huggingface_hub then deletes nothing itself; the loop above removed our own files.
    save_torch_state_dict(
        state, out, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size, is_main_process=False
    )


def _refuse_other_model(model: nn.Module, out: Path) -> None:
    """Raise `CheckpointError` if `out` holds files a save would replace that belong to a different model."""
    ours = sorted(
        p.name
        for p in out.iterdir()
        if p.name in (CONFIG_FILE, GENERATION_CONFIG_FILE) or OWN_WEIGHT_FILES.fullmatch(p.name)
    )
    if not ours:
        return
    hint = "pass overwrite=True to replace them"
    if not (out / CONFIG_FILE).exists():
        raise CheckpointError(f"save_pretrained: {str(out)!r} holds {ours} but no config.json to tell whose; {hint}")
    try:
        with torch.device("meta"):
            other = type(model)(read_config(out))
    except (CheckpointError, ConfigError) as err:
        raise CheckpointError(
            f"save_pretrained: {str(out)!r} holds another model's files {ours} ({err}); {hint}"
        ) from err
    theirs, mine = expected_disk_shapes(other), expected_disk_shapes(model)
    if theirs != mine:
        diff = sorted(set(theirs.items()) ^ set(mine.items()))[:3]
        raise CheckpointError(
            f"save_pretrained: {str(out)!r} holds a different model's files {ours} (its tensors differ, e.g. "
            f"{[name for name, _ in diff]}); {hint}"
        )
