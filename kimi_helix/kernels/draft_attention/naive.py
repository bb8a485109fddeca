"""Pure-PyTorch reference of the DSpark drafter's serving attention: a block of G queries per request over the
visible rows of its slot in the context cache and the block's own G keys (non-causal), one softmax over both.

This is the drafter's former per-layer path, written out: gather the slots' cache rows (`ContextCache.gather`),
concatenate them with the block's keys/values, mask the rows at or past each request's length, and SDPA in the input
dtype (`DSparkAttention.forward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimi_helix.kernels.common import check_device, check_index, check_shape

__all__ = ["check_draft_attention_args", "draft_attention_ref"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_draft_attention_args(q, k_blk, v_blk, k_ctx, v_ctx, slots, lengths) -> None:
    """Shape, dtype and device checks shared by the reference and the Triton kernel (no device reads: the slot
    ids and lengths themselves are the caller's contract)."""
    if q.dim() != 4 or q.dtype not in _DTYPES:
        raise ValueError(f"q must be a fp32/fp16/bf16 tensor [N, G, H, D], got {q.dtype} {list(q.shape)}")
    n, _, h, d = q.shape
    if k_ctx.dim() != 4 or k_ctx.shape[2:] != (h, d):
        raise ValueError(f"k_ctx must have shape [S, C, H, D] with H={h}, D={d}, got {list(k_ctx.shape)}")
    for name, t, expected, desc in (
        ("k_blk", k_blk, q.shape, "[N, G, H, D]"),
        ("v_blk", v_blk, q.shape, "[N, G, H, D]"),
        ("v_ctx", v_ctx, k_ctx.shape, "[S, C, H, D]"),
    ):
        check_shape(name, t, expected, desc)
    for name, t in (("k_blk", k_blk), ("v_blk", v_blk), ("k_ctx", k_ctx), ("v_ctx", v_ctx)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        check_device(name, t, q.device)
    check_index("slots", slots, n, q.device)
    check_index("lengths", lengths, n, q.device)


# Twin of kernels/draft_attention/triton.py:draft_attention_triton (same signature and results): a change to one
# belongs in both.
def draft_attention_ref(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of each request's block over its visible context rows and its whole block.

    Args:
        q, k_blk, v_blk: [N, G, H, D] the block's queries, keys and values (fp32/fp16/bf16, one dtype).
        k_ctx, v_ctx: [S, C, H, D] the context cache: S slots of C rows, q's dtype.
        slots: [N] int64 (or int32), the cache slot of each request, in [0, S).
        lengths: [N] int64 (or int32), the visible context rows of each request: rows [0, length) of its slot.
            A length past C sees all C rows, one below 1 none.
        scale: the softmax scale, default 1 / sqrt(D).

    Rows at or past a length are gathered and masked by SDPA, which adds -inf to their scores: they must be finite
    (a NaN there reaches every output of its request). The Triton kernel never reads them.

    Returns:
        out [N, G, H, D] in q's dtype (a transposed view of SDPA's [N, H, G, D]).
    """
    check_draft_attention_args(q, k_blk, v_blk, k_ctx, v_ctx, slots, lengths)
    g, c = q.shape[1], k_ctx.shape[1]
    k = torch.cat([k_ctx.index_select(0, slots), k_blk], dim=1).transpose(1, 2)
    v = torch.cat([v_ctx.index_select(0, slots), v_blk], dim=1).transpose(1, 2)
    visible = F.pad(torch.arange(c, device=q.device)[None] < lengths[:, None], (0, g), value=True)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return out.transpose(1, 2)
