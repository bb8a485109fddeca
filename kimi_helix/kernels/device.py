"""Facts about the device that launch decisions depend on."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (`TRITON_INTERPRET=1`). Triton reads the variable when a
    kernel module is imported, so it cannot usefully change later in a process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_devices() -> frozenset[str]:
    """The devices a Triton kernel can run on: CUDA, plus the CPU under the interpreter."""
    return frozenset({"cuda", "cpu"} if interpreting() else {"cuda"})


@functools.cache
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device; without CUDA, an H200's 132, so the Triton interpreter exercises
    the same launch decisions as that GPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return 132


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device, asked of the driver once: launchers check it on every
    call."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def side_stream(device_index: int) -> torch.cuda.Stream:
    """A CUDA stream of the device kept for kernels that overlap others within one call (the KDA prefill's block
    kernel): one per device, not one per call, which would cost every call a stream creation on the host."""
    return torch.cuda.Stream(device_index)
