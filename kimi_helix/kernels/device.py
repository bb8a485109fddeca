"""Facts about the device that launch decisions depend on."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device; without CUDA, an H200's 132, so the Triton interpreter exercises
    the same launch decisions as that GPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return 132
