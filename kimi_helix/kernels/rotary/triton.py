"""Triton rotary embedding: one program per token rotates every head of it, cos/sin computed in the kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import next_pow2
from kimi_helix.kernels.rotary.naive import inv_freq

__all__ = ["CAPS", "rotary_triton"]

# What the kernel serves, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def rotary_fwd_kernel(x, positions, inv_freq, y, stride_xt, stride_xh, M, HALF, BM: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o_m = tl.arange(0, BM)
    o_i = tl.arange(0, BH)
    m_i = o_i < HALF
    mask = (o_m < M)[:, None] & m_i[None, :]
    # fp32 position times the same fp32 table as the reference: the angle is bitwise the reference's
    freqs = tl.load(positions + t).to(tl.float32) * tl.load(inv_freq + o_i, mask=m_i, other=0.0)
    cos = tl.cos(freqs)[None, :]
    sin = tl.sin(freqs)[None, :]
    src = x + t * stride_xt + o_m[:, None] * stride_xh + o_i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = y + (t * M + o_m[:, None]) * (2 * HALF) + o_i[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(y.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(y.dtype.element_ty), mask=mask)


def rotary_triton(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Triton form of :func:`kimi_helix.kernels.rotary.naive.rotary_ref` (same arguments and result).

    Args:
        x: [N, ..., D] fp32/fp16/bf16, D even; the middle dims must flatten to one stride (a head axis), the last
            dim contiguous: e.g. the rope slice q[..., nope:] of a [T, H, nope + rope] projection.
        positions: [N] integer positions.
        theta: the rotary base.

    Returns:
        [N, ..., D] contiguous in x.dtype.
    """
    if x.dim() < 2 or x.dtype not in _DTYPES or x.shape[-1] % 2:
        raise ValueError(f"x must be an [N, ..., D] fp32/fp16/bf16 tensor with D even, got {x.dtype} {list(x.shape)}")
    n, d = x.shape[0], x.shape[-1]
    if positions.shape != (n,) or positions.is_floating_point() or positions.device != x.device:
        raise ValueError(f"positions must be integer [N]=[{n}] on {x.device}, got {positions.dtype} {positions.shape}")
    check_triton_device("x", x)
    x3 = x.reshape(n, -1, d)  # a view for head slices of a projection; copies only layouts that cannot flatten
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    m = x3.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n > 0 and m > 0:
        rotary_fwd_kernel[(n,)](
            x3,
            positions,
            inv_freq(d, theta, x.device),
            y,
            x3.stride(0),
            x3.stride(1),
            m,
            d // 2,
            BM=next_pow2(m),
            BH=next_pow2(d // 2),
            num_warps=4 if m * d >= 4096 else 1,
        )
    return y
