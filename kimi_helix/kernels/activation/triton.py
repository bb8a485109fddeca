"""Triton SwiGLU activation: `silu(gate) * up` in one pass (torch spends two kernels and an intermediate)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import cdiv, next_pow2

__all__ = ["CAPS", "silu_mul_triton"]

# What the kernel serves, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024


@triton.jit
def silu_mul_kernel(gate, up, out, n_cols, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_u + cols, mask=mask, other=0.0)
    # silu rounded to the inputs' dtype before the product, as the two torch ops it replaces
    s = (g * tl.sigmoid(g)).to(u.dtype).to(tl.float32)
    tl.store(out + row * n_cols + cols, (s * u.to(tl.float32)).to(out.dtype.element_ty), mask=mask)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton form of :func:`kimi_helix.kernels.activation.naive.silu_mul_ref` (same arguments and result).

    Args:
        gate, up: [..., I] fp32/fp16/bf16 of one dtype and shape; rows may be strided (the two halves of a fused
            gate/up projection), the last dim contiguous.

    Returns:
        [..., I] contiguous in the inputs' dtype.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in _DTYPES or gate.dim() < 1:
        raise ValueError(
            f"gate and up must be [..., I] fp32/fp16/bf16 tensors of one shape and dtype, got {gate.dtype} "
            f"{list(gate.shape)} and {up.dtype} {list(up.shape)}"
        )
    if gate.device != up.device:
        raise ValueError(f"up is on {up.device}, gate on {gate.device}")
    check_triton_device("gate", gate)
    n = gate.shape[-1]
    g2, u2 = (t.reshape(-1, n) for t in (gate, up))
    g2, u2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (g2, u2))
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0] > 0 and n > 0:
        block = min(BLOCK, next_pow2(n))
        silu_mul_kernel[(g2.shape[0], cdiv(n, block))](
            g2, u2, out, n, g2.stride(0), u2.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 1
        )
    return out
