"""Triton DSpark draft attention: a request's block over its slot's visible context rows and its own keys, in one
launch.

`draft_attention_ref` costs about eight small kernels a layer (two gathers, two concatenations, the mask, SDPA and
its layout copies), and a drafting round at serving batch sizes is bound by launches, not FLOPs. Here one program
owns one (request, head): it loads the block's G queries as one [BLOCK_G, D] tile, sweeps the context rows of its
slot straight from the cache in [BLOCK_C, D] tiles with an online softmax (base 2, fp32), then the block's G keys as a
last tile, and writes the G rows. The sweep stops at the request's length, so rows past it are never read: stale or
uninitialised cache rows cannot reach the output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kimi_helix.kernels.backends import FLOATS, OpCaps
from kimi_helix.kernels.common import check_triton_device
from kimi_helix.kernels.device import triton_devices
from kimi_helix.kernels.draft_attention.naive import check_draft_attention_args
from kimi_helix.kernels.launch import next_pow2

__all__ = ["CAPS", "HEAD_DIMS", "block_c", "draft_attention_triton"]

# tl.arange and tl.dot need the head dim a power of two, at least 16; 256 bounds the tiles' registers.
HEAD_DIMS = (16, 256)
# What the kernel serves, read by the backend switch (head_dim: the dispatcher passes D).
CAPS = OpCaps(triton_devices(), FLOATS, head_dims=HEAD_DIMS)
MAX_BLOCK_C = 64  # context rows a tile
TILE_ELEMENTS = 8192  # elements of one K or V tile [BLOCK_C, D]: 16 KB in 16 bits
_LOG2E = 1.0 / math.log(2.0)


def block_c(d: int) -> int:
    """Context rows of one tile at head dim d: 64, fewer from D = 256 on (tl.dot wants at least 16)."""
    return max(16, min(MAX_BLOCK_C, TILE_ELEMENTS // d))


@triton.jit
def _attend(qt, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax: q [BG, D] against k, v [BK, D] where `visible` [BK]; returns the running
    (max, sum, accumulator). Every tile has a visible key, so the max is finite from the first tile on."""
    s = tl.dot(qt, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def draft_attention_kernel(
    q, k_blk, v_blk, k_ctx, v_ctx, slots, lengths, out, G, C, qk_scale,
    stride_qn, stride_qg, stride_qh, stride_qd, stride_kbn, stride_kbg, stride_kbh, stride_kbd,
    stride_vbn, stride_vbg, stride_vbh, stride_vbd, stride_kcs, stride_kcc, stride_kch, stride_kcd,
    stride_vcs, stride_vcc, stride_vch, stride_vcd, stride_on, stride_og, stride_oh, stride_slot, stride_len,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (request n, head h). qk_scale = softmax scale * log2(e)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    o_g = tl.arange(0, BLOCK_G)
    o_c = tl.arange(0, BLOCK_C)
    o_d = tl.arange(0, D)
    in_g = o_g < G
    qt = tl.load(q + n * stride_qn + h * stride_qh + o_g[:, None] * stride_qg + o_d[None, :] * stride_qd,
                 mask=in_g[:, None], other=0.0)  # fmt: skip
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    # the loop bound is the length, so only tiles holding a visible row are loaded, and only their visible rows;
    # clamped to C as the reference's mask is
    slot = tl.load(slots + n * stride_slot).to(tl.int64)
    length = tl.minimum(tl.load(lengths + n * stride_len).to(tl.int64), C)
    k_rows = k_ctx + slot * stride_kcs + h * stride_kch + o_d[None, :] * stride_kcd
    v_rows = v_ctx + slot * stride_vcs + h * stride_vch + o_d[None, :] * stride_vcd
    for c0 in range(0, length, BLOCK_C):
        rows = c0 + o_c
        visible = rows < length
        k = tl.load(k_rows + rows[:, None] * stride_kcc, mask=visible[:, None], other=0.0)
        v = tl.load(v_rows + rows[:, None] * stride_vcc, mask=visible[:, None], other=0.0)
        m_i, l_i, acc = _attend(qt, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    # the block's own keys, all visible to all its queries (non-causal): the last tile, which every row has
    k = tl.load(k_blk + n * stride_kbn + h * stride_kbh + o_g[:, None] * stride_kbg + o_d[None, :] * stride_kbd,
                mask=in_g[:, None], other=0.0)  # fmt: skip
    v = tl.load(v_blk + n * stride_vbn + h * stride_vbh + o_g[:, None] * stride_vbg + o_d[None, :] * stride_vbd,
                mask=in_g[:, None], other=0.0)  # fmt: skip
    m_i, l_i, acc = _attend(qt, k, v, in_g, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    o = (acc / l_i[:, None]).to(out.dtype.element_ty)
    tl.store(out + n * stride_on + h * stride_oh + o_g[:, None] * stride_og + o_d[None, :], o, mask=in_g[:, None])


# Twin of kernels/draft_attention/naive.py:draft_attention_ref (same signature and results): a change to one belongs
# in both.
def draft_attention_triton(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Triton form of :func:`kimi_helix.kernels.draft_attention.naive.draft_attention_ref`: the same arguments and
    result (out [N, G, H, D] in q's dtype, contiguous) in one launch over (N, H), no host sync.

    Args:
        q, k_blk, v_blk: [N, G, H, D] the block (any strides, e.g. views of a packed qkv projection).
        k_ctx, v_ctx: [S, C, H, D] the context cache (any strides); rows past each length are never read.
        slots, lengths: [N] int64 (or int32); scale: default 1 / sqrt(D).

    D must be a power of two in `HEAD_DIMS` (ValueError otherwise; the switch's `CAPS` declare it). fp32 inputs use
    exact fp32 dots (no TF32).
    """
    check_draft_attention_args(q, k_blk, v_blk, k_ctx, v_ctx, slots, lengths)
    check_triton_device("q", q)
    n, g, h, d = q.shape
    lo, hi = HEAD_DIMS
    if not (lo <= d <= hi and d & (d - 1) == 0):
        raise ValueError(f"q's head dim D={d} is not a power of two in [{lo}, {hi}] (the Triton kernel's tiles)")
    out = torch.empty(n, g, h, d, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    scale = d**-0.5 if scale is None else scale
    draft_attention_kernel[(n, h)](
        q, k_blk, v_blk, k_ctx, v_ctx, slots, lengths, out, g, k_ctx.shape[1], float(scale) * _LOG2E,
        *q.stride(), *k_blk.stride(), *v_blk.stride(), *k_ctx.stride(), *v_ctx.stride(), *out.stride()[:3],
        slots.stride(0), lengths.stride(0), D=d, BLOCK_G=max(16, next_pow2(g)), BLOCK_C=block_c(d),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    return out
