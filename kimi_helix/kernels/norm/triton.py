"""Triton gated RMSNorm: ``rmsnorm(x) * weight * sigmoid(gate)``, one row per program, fp32 maths."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.device import interpreting, triton_devices
from kimi_helix.kernels.launch import next_pow2

__all__ = ["CAPS", "gated_rms_norm_triton"]

# What the kernel serves, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def gated_rms_norm_fwd_kernel(x, gate, weight, y, stride_x, stride_g, D, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    mask = o_d < D
    b_x = tl.load(x + row * stride_x + o_d, mask=mask, other=0.0).to(tl.float32)
    b_g = tl.load(gate + row * stride_g + o_d, mask=mask, other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=mask, other=0.0).to(tl.float32)
    # padded lanes load 0, so the sum is over the D real channels only
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x) / D + eps)
    tl.store(y + row * D + o_d, (b_w * b_x * b_r * tl.sigmoid(b_g)).to(y.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """``[..., D]`` -> ``[rows, D]`` with unit stride along D (a view when the layout allows)."""
    t = t.reshape(-1, D)
    return t if t.stride(-1) == 1 else t.contiguous()


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton form of :func:`kimi_helix.kernels.norm.naive.gated_rms_norm_ref`.

    Args:
        x: ``[..., D]`` fp32/fp16/bf16.
        gate: ``[..., D]``, same shape as x (any float dtype).
        weight: ``[D]``.
        eps: added to the mean square inside the rsqrt.

    Returns:
        ``[..., D]`` in x.dtype (contiguous).
    """
    if x.dim() < 1 or x.shape[-1] < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be a [..., D] fp32/fp16/bf16 tensor, got {x.dtype} {list(x.shape)}")
    D = x.shape[-1]
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {list(x.shape)}, got {list(gate.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"weight must have shape [D]=[{D}], got {list(weight.shape)}")
    for name, t in (("gate", gate), ("weight", weight)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"x is on {x.device}: the Triton kernel needs CUDA (or TRITON_INTERPRET=1 on the CPU)")
    x2, g2 = _rows(x, D), _rows(gate, D)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        bd = next_pow2(D)
        gated_rms_norm_fwd_kernel[(x2.shape[0],)](
            x2,
            g2,
            weight.contiguous(),
            y,
            x2.stride(0),
            g2.stride(0),
            D,
            eps,
            BD=bd,
            num_warps=min(max(bd // 256, 1), 8),
        )
    return y
