"""Where each parameter of a model being loaded goes: one device, or a `device_map` placed by accelerate.

`device_map` is a single device (`"cuda:0"`, `0`, `torch.device`), a dict of module name -> device as
transformers takes it, or a strategy (`"auto"`, `"balanced"`, `"balanced_low_0"`, `"sequential"`) that
accelerate resolves over the GPUs and the CPU from the model's meta-device shapes. Without a GPU, every strategy
puts everything on the CPU. Disk offload is not supported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _device(value, what: str) -> torch.device:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    if isinstance(value, str) and value != "disk":
        try:
            return torch.device(value)
        except RuntimeError:
            pass
    raise ValueError(f"{what} must name a device (e.g. 'cpu', 'cuda:0', 0), got {value!r}")


def _infer(model: nn.Module, strategy: str, dtype: torch.dtype, max_memory) -> dict:
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(model._no_split_modules or [])
    if strategy != "sequential":
        max_memory = get_balanced_memory(
            model, max_memory, no_split_module_classes=no_split, dtype=dtype, low_zero=strategy == "balanced_low_0"
        )
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    if "disk" in device_map.values():
        raise ValueError(
            f"device_map={strategy!r}: the model does not fit in the GPUs' and the CPU's memory "
            f"(max_memory={max_memory}); kimi_helix does not offload to disk"
        )
    return device_map


def param_devices(
    model: nn.Module, device, device_map, dtype: torch.dtype, max_memory=None
) -> tuple[Callable[[str], torch.device], dict[str, torch.device] | None]:
    """(parameter name -> device, the module-level device map or None for a single device)."""
    if device is not None and device_map is not None:
        raise ValueError(f"pass device or device_map, not both (got device={device!r}, device_map={device_map!r})")
    if not isinstance(device_map, dict) and device_map not in STRATEGIES:
        if device_map is None:
            one = _device("cpu" if device is None else device, "device")
        else:
            one = _device(device_map, "device_map")
        return (lambda name: one), None
    if isinstance(device_map, str):
        device_map = _infer(model, device_map, dtype, max_memory)
    placed = {str(k): _device(v, f"device_map[{k!r}]") for k, v in device_map.items()}

    def devices(name: str) -> torch.device:
        owners = [k for k in placed if k == "" or name == k or name.startswith(k + ".")]
        if not owners:
            raise ValueError(f"device_map places no module that holds parameter {name!r}")
        return placed[max(owners, key=len)]

    return devices, placed


def dispatch(model: nn.Module, device_map: dict[str, torch.device] | None) -> None:
    """Hook a model spread over several devices so that activations follow the layers (accelerate's hooks), and
    move each decoder layer's `ForwardBatch` (positions, cu_seqlens) to that layer's device."""
    if device_map is None:
        return
    model.hf_device_map = {k: str(v) for k, v in device_map.items()}
    if len(set(device_map.values())) == 1:
        return
    from accelerate import dispatch_model

    from .model import KimiK3DecoderLayer

    dispatch_model(model, device_map=device_map)
    for module in model.modules():
        if isinstance(module, KimiK3DecoderLayer):
            module.register_forward_pre_hook(_batch_to(next(module.parameters()).device))


def _batch_to(device: torch.device):
    def hook(module, args):
        x, batch, *rest = args
        if batch.positions.device != device:
            batch = dataclasses.replace(
                batch, cu_seqlens=batch.cu_seqlens.to(device), positions=batch.positions.to(device)
            )
        return (x, batch, *rest)

    return hook
