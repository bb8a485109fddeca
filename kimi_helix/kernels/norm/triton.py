"""Triton norms, one program per row with fp32 maths: the gated RMSNorm ``rmsnorm(x) * weight * sigmoid(gate)``
and add + RMSNorm (writes the sum and the normalised row in one pass)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_device, check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import next_pow2

__all__ = ["CAPS", "add_rms_norm_triton", "gated_rms_norm_triton"]

# What both kernels serve, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _row_offset(row, INNER, stride_outer, stride_inner):
    """Row `row` of a [outer, INNER, D] layout (INNER = 1: plain strided rows)."""
    return (row // INNER) * stride_outer + (row % INNER) * stride_inner


@triton.jit
def gated_rms_norm_fwd_kernel(x, gate, weight, y, stride_x, stride_xi, stride_g, stride_gi, INNER, D, eps,
                              BD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    mask = o_d < D
    b_x = tl.load(x + _row_offset(row, INNER, stride_x, stride_xi) + o_d, mask=mask, other=0.0).to(tl.float32)
    b_g = tl.load(gate + _row_offset(row, INNER, stride_g, stride_gi) + o_d, mask=mask, other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=mask, other=0.0).to(tl.float32)
    # padded lanes load 0, so the sum is over the D real channels only
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x) / D + eps)
    tl.store(y + row * D + o_d, (b_w * b_x * b_r * tl.sigmoid(b_g)).to(y.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_norm_fwd_kernel(
    x, residual, weight, y, h, stride_x, stride_xi, stride_r, stride_ri, INNER, D, eps, HAS_RESIDUAL: tl.constexpr,
    BD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    mask = o_d < D
    b_h = tl.load(x + _row_offset(row, INNER, stride_x, stride_xi) + o_d, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # rounded to x's dtype before the norm, as the torch add it replaces
        b_r = tl.load(residual + _row_offset(row, INNER, stride_r, stride_ri) + o_d, mask=mask, other=0.0)
        b_h = (b_h.to(tl.float32) + b_r.to(tl.float32)).to(b_h.dtype)
        tl.store(h + row * D + o_d, b_h, mask=mask)
    b_f = b_h.to(tl.float32)
    # padded lanes load 0, so the sum is over the D real channels only
    b_r = 1.0 / tl.sqrt(tl.sum(b_f * b_f) / D + eps)
    b_n = (b_f * b_r).to(b_h.dtype).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * D + o_d, (b_w * b_n).to(y.dtype.element_ty), mask=mask)


def _check_rows(x: torch.Tensor, weight: torch.Tensor, **others: torch.Tensor | None) -> int:
    """The checks both kernels share: x a [..., D] float tensor on a Triton device, weight [D] and every other
    tensor given on x's device. Returns D."""
    if x.dim() < 1 or x.shape[-1] < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be a [..., D] fp32/fp16/bf16 tensor, got {x.dtype} {list(x.shape)}")
    D = x.shape[-1]
    if weight.shape != (D,) or not weight.is_floating_point():
        raise ValueError(f"weight must be a float tensor of shape [D]=[{D}], got {weight.dtype} {list(weight.shape)}")
    for name, t in (*others.items(), ("weight", weight)):
        if t is not None:
            check_device(name, t, x.device, ref="x")
    check_triton_device("x", x)
    return D


def _rows(t: torch.Tensor, D: int, inner: int | None = None) -> tuple[torch.Tensor, int, int, int]:
    """[..., D] -> (t, or a copy with unit stride along D; stride_outer, stride_inner, INNER): row r starts at
    (r // INNER) * stride_outer + (r % INNER) * stride_inner. Rows of one stride take INNER = 1; per-head rows of a
    slice of a wider projection ([..., H, D] whose leading dims merge, but not with H) take INNER = H, so they are
    read in place rather than copied. `inner` asks for a given INNER (a second operand indexed like the first)."""
    if t.stride(-1) == 1:
        try:
            s = t.view(-1, D).stride(0)
            return (t, s, 0, 1) if inner in (None, 1) else (t, inner * s, s, inner)
        except RuntimeError:
            pass
        if t.dim() >= 3 and inner in (None, t.shape[-2]):
            try:
                heads = t.view(-1, t.shape[-2], D)
                return t, heads.stride(0), heads.stride(1), t.shape[-2]
            except RuntimeError:
                pass
    return _rows(t.reshape(-1, D).contiguous(), D, inner)


def _row_block(D: int) -> dict[str, int]:
    """The launch options of a one-row-per-program kernel: the padded row width and warps to cover it."""
    bd = next_pow2(D)
    return {"BD": bd, "num_warps": min(max(bd // 256, 1), 8)}


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton form of :func:`kimi_helix.kernels.norm.naive.gated_rms_norm_ref`.

    Args:
        x: [..., D] fp32/fp16/bf16; rows may be strided.
        gate: [..., D], same shape as x (any float dtype).
        weight: [D].
        eps: added to the mean square inside the rsqrt.

    Returns:
        [..., D] in x.dtype (contiguous).
    """
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {list(x.shape)}, got {list(gate.shape)}")
    D = _check_rows(x, weight, gate=gate)
    # the gate first: it is the one read in place from a wider projection (KDA's [T, H, K] slice, whose tokens do not
    # merge with its heads), and x's rows take its INNER, so that neither is copied
    g2, sg, sgi, inner = _rows(gate, D)
    x2, sx, sxi, _ = _rows(x, D, inner)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // D
    if rows > 0:
        gated_rms_norm_fwd_kernel[(rows,)](
            x2, g2, weight.contiguous(), y, sx, sxi, sg, sgi, inner, D, eps, **_row_block(D)
        )
    return y


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton form of :func:`kimi_helix.kernels.norm.naive.add_rms_norm_ref` (same arguments and results).

    Args:
        x: [..., D] fp32/fp16/bf16; rows may be strided (a slice of a wider projection).
        residual: [..., D] in x.dtype, or None.
        weight: [D] any float dtype.
        eps: added to the mean square inside the rsqrt.

    Returns:
        (y [..., D] contiguous in the promoted dtype of weight and x, h [..., D]: x + residual, contiguous; x itself
        when residual is None).
    """
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must have x's shape {list(x.shape)} and dtype {x.dtype}, got {list(residual.shape)} "
            f"{residual.dtype}"
        )
    D = _check_rows(x, weight, residual=residual)
    x2, sx, sxi, inner = _rows(x, D)
    r2, sr, sri, _ = _rows(residual, D, inner) if residual is not None else (x2, sx, sxi, inner)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    rows = x.numel() // D
    if rows > 0:
        add_rms_norm_fwd_kernel[(rows,)](
            x2, r2, weight.contiguous(), y, h, sx, sxi, sr, sri, inner, D, eps, HAS_RESIDUAL=residual is not None,
            **_row_block(D),
        )  # fmt: skip
    return y, h
