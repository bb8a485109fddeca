"""Pure-PyTorch reference of the rotary embedding (rotate-half / GPT-NeoX layout)."""

from __future__ import annotations

import functools

import torch

__all__ = ["inv_freq", "rotary_ref"]


@functools.cache
def _inv_freq(d: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))


def inv_freq(d: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """[d / 2] fp32 `theta ** (-2i / d)`, computed once per (d, theta, device): a per-call table would cost four
    kernels a call, and a CUDA graph captured after the first call replays the cached tensor."""
    return _inv_freq(d, float(theta), torch.device(device))


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the last dim of `x` by position, computed in fp32 (rotate-half layout: pairs (i, i + D/2)).

    Args:
        x: [N, ..., D] with D even; N tokens.
        positions: [N] absolute positions (any integer dtype).
        theta: the rotary base.

    Returns:
        [N, ..., D] in x.dtype.
    """
    d = x.shape[-1]
    freqs = positions.to(torch.float32)[:, None] * inv_freq(d, theta, x.device)[None, :]  # [N, D/2]
    cos = freqs.cos().repeat(1, 2).view(x.shape[0], *([1] * (x.dim() - 2)), d)
    sin = freqs.sin().repeat(1, 2).view(x.shape[0], *([1] * (x.dim() - 2)), d)
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
