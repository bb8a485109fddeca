"""Checks of `LLM`'s arguments: each raises ValueError naming the argument and what it allows."""

from __future__ import annotations

import numbers
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_arguments(model, device, device_map, parallel: bool, gpu_memory_utilization, **sizes) -> None:
    """Raise ValueError naming the first bad `LLM` argument: `sizes` must be positive ints (or None)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    for name, value in sizes.items():
        if value is not None and (not is_int(value) or value <= 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if device_map is None:
        return
    if device_map != "auto":
        raise ValueError(f"device_map must be None or 'auto', got {device_map!r}")
    if device is not None:
        raise ValueError(f"pass device_map='auto' or device={device!r}, not both")
    if not isinstance(model, (str, Path)):
        raise ValueError("device_map='auto' places a checkpoint folder's layers; a loaded model is already placed")
    if parallel:
        raise ValueError("device_map='auto' cannot be combined with tensor_parallel_size * context_parallel_size > 1")


def check_async_scheduling(value, parallel: bool) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"async_scheduling must be None, True or False, got {value!r}")
    if value and parallel:
        raise ValueError(
            "async_scheduling=True needs tensor_parallel_size * context_parallel_size == 1 (the ranks agree on rank "
            "0's tokens every step); leave async_scheduling=None or set it False"
        )


def check_dtype(dtype) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(
        f"dtype must be None (the model's) or one of {', '.join(DTYPES)} (a torch.dtype or its name), got {dtype!r}"
    )


def check_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be None, a str such as 'cpu' or 'cuda:0', or a torch.device, got {device!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"device {device!r} is not a device (try 'cpu', 'cuda', 'cuda:1')") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be on cpu or cuda, got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available here")
    return device


# The most drafts a CUDA-graphed verify group carries (`engine.cuda_graph`: verify graphs take k <= 8).
MAX_GRAPH_DRAFT_TOKENS = 8


def graph_draft_tokens(max_draft_tokens, speculative_k: int | None, page_size: int) -> int:
    """Drafts per verify group that CUDA-graphed verify steps take: `max_draft_tokens` when given (0 to 8, and
    1 + k within a page), else the speculative config's k (clipped to what a graph takes: larger groups run
    eagerly), else 0: no verify graphs, so no memory is set aside for their scratch."""
    limit = min(MAX_GRAPH_DRAFT_TOKENS, page_size - 1)
    if max_draft_tokens is None:
        return min(speculative_k or 0, limit)
    if not is_int(max_draft_tokens) or not 0 <= max_draft_tokens <= limit:
        raise ValueError(
            f"max_draft_tokens must be None or an int in [0, {limit}] (at most {MAX_GRAPH_DRAFT_TOKENS}, and 1 + k "
            f"tokens within a page of {page_size}), got {max_draft_tokens!r}"
        )
    return int(max_draft_tokens)
