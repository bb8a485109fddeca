"""Triton per-head RMSNorm then RoPE: one program per token normalises and rotates all its heads, and either
stores them as rows of the output or scatters them (and the token's values) into a per-slot context cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.launch import next_pow2
from kimi_helix.kernels.norm_rotary.naive import check_into_cache_args, check_norm_rotary_args, weight_list
from kimi_helix.kernels.rotary.naive import inv_freq

__all__ = ["CAPS", "norm_rotary_into_cache_triton", "norm_rotary_triton"]

# What both entry points serve, read by the backend switch.
CAPS = OpCaps(triton_devices(), FLOATS)


@triton.jit
def norm_rotary_kernel(
    x, positions, inv_freq, w0, w1, y, v, v_out, slots, stride_xt, stride_xh, stride_vt, stride_vh, stride_yt,
    stride_yh, stride_ys, stride_vot, stride_voh, stride_vos, M, HEADS_PER_W, HALF, eps, BM: tl.constexpr,
    BH: tl.constexpr, TWO_WEIGHTS: tl.constexpr, INTO_CACHE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    o_m = tl.arange(0, BM)
    o_i = tl.arange(0, BH)
    mask = (o_m < M)[:, None] & (o_i < HALF)[None, :]
    src = x + t * stride_xt + o_m[:, None] * stride_xh + o_i[None, :]
    b_x = tl.load(src, mask=mask, other=0.0)
    x1, x2 = b_x.to(tl.float32), tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # padded lanes load 0, so the mean is over the D real channels only
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    # `RMSNorm` rounds the normalised row to x's dtype, then the weight product too (the rotation reads that)
    n1 = (x1 * rstd[:, None]).to(b_x.dtype).to(tl.float32)
    n2 = (x2 * rstd[:, None]).to(b_x.dtype).to(tl.float32)
    wa1 = tl.load(w0 + o_i, mask=o_i < HALF, other=0.0).to(tl.float32)[None, :]
    wa2 = tl.load(w0 + HALF + o_i, mask=o_i < HALF, other=0.0).to(tl.float32)[None, :]
    if TWO_WEIGHTS:  # heads from HEADS_PER_W on take the second weight (k's norm after q's)
        second = (o_m >= HEADS_PER_W)[:, None]
        wa1 = tl.where(second, tl.load(w1 + o_i, mask=o_i < HALF, other=0.0).to(tl.float32)[None, :], wa1)
        wa2 = tl.where(second, tl.load(w1 + HALF + o_i, mask=o_i < HALF, other=0.0).to(tl.float32)[None, :], wa2)
    a1 = (wa1 * n1).to(b_x.dtype).to(tl.float32)
    a2 = (wa2 * n2).to(b_x.dtype).to(tl.float32)
    # fp32 position times the same fp32 table as the reference: the angle is bitwise the reference's
    pos = tl.load(positions + t).to(tl.int64)
    freqs = pos.to(tl.float32) * tl.load(inv_freq + o_i, mask=o_i < HALF, other=0.0)
    cos, sin = tl.cos(freqs)[None, :], tl.sin(freqs)[None, :]
    if INTO_CACHE:
        slot = tl.load(slots + t).to(tl.int64)
        row = y + slot * stride_ys + pos * stride_yt
    else:
        row = y + t * stride_yt
    dst = row + o_m[:, None] * stride_yh + o_i[None, :]
    tl.store(dst, (a1 * cos - a2 * sin).to(y.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (a2 * cos + a1 * sin).to(y.dtype.element_ty), mask=mask)
    if INTO_CACHE:  # the token's values go to the same row of the value cache, unchanged
        p_v = v + t * stride_vt + o_m[:, None] * stride_vh + o_i[None, :]
        p_o = v_out + slot * stride_vos + pos * stride_vot + o_m[:, None] * stride_voh + o_i[None, :]
        tl.store(p_o, tl.load(p_v, mask=mask), mask=mask)
        tl.store(p_o + HALF, tl.load(p_v + HALF, mask=mask), mask=mask)


def _launch(x, positions, weights, eps, theta, y, y_strides, v=None, v_out=None, slots=None) -> None:
    """One program per token of x [N, H, D]: the heads' rows go to y at y_strides (token or position, head, slot)."""
    n, h, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if n == 0 or h == 0:
        return
    into_cache = v_out is not None
    if into_cache and v.stride(-1) != 1:
        v = v.contiguous()
    v_strides = (v.stride(0), v.stride(1)) if into_cache else (0, 0)
    vo_strides = (v_out.stride(1), v_out.stride(2), v_out.stride(0)) if into_cache else (0, 0, 0)
    w = [wi.contiguous() for wi in weights]
    norm_rotary_kernel[(n,)](
        x, positions, inv_freq(d, theta, x.device), w[0], w[-1], y, v, v_out, slots, x.stride(0), x.stride(1),
        *v_strides, *y_strides, *vo_strides, h, h // len(w), d // 2, float(eps), BM=next_pow2(h),
        BH=next_pow2(d // 2), TWO_WEIGHTS=len(w) == 2, INTO_CACHE=into_cache, num_warps=4 if h * d >= 4096 else 1,
    )  # fmt: skip


def norm_rotary_triton(x, positions, weights, eps: float, theta: float) -> torch.Tensor:
    """Triton form of :func:`kimi_helix.kernels.norm_rotary.naive.norm_rotary_ref` (same arguments and result):
    x [N, H, D] (heads of one stride, e.g. q's and k's heads of a packed projection read in place) -> [N, H, D]
    contiguous, one launch."""
    weights = weight_list(weights)
    check_norm_rotary_args(x, positions, weights)
    check_triton_device("x", x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, positions, weights, eps, theta, y, (y.stride(0), y.stride(1), 0))
    return y


def norm_rotary_into_cache_triton(k, v, positions, weight, eps: float, theta: float, k_cache, v_cache, slots) -> None:
    """Triton form of :func:`kimi_helix.kernels.norm_rotary.naive.norm_rotary_into_cache_ref` (same arguments and
    effect), one launch: k [T, H, D] normed and rotated into k_cache [S, C, H, D] at (slots, positions), v into
    v_cache. The slots and positions are not checked against the cache on the host (that would sync)."""
    check_triton_device("k", k)
    check_into_cache_args(k, v, positions, weight, k_cache, v_cache, slots)
    y_strides = (k_cache.stride(1), k_cache.stride(2), k_cache.stride(0))
    _launch(k, positions, [weight], eps, theta, k_cache, y_strides, v, v_cache, slots)
