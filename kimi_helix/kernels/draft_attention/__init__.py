"""The DSpark drafter's serving attention (a request's block over its slot's visible context rows and the block
itself), dispatched by the op switch."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.draft_attention.naive import draft_attention_ref


def draft_attention(q, k_blk, v_blk, k_ctx, v_ctx, slots, lengths, scale=None, *, backend=None):
    """q, k_blk, v_blk [N, G, H, D], k_ctx, v_ctx [S, C, H, D], slots, lengths [N] -> out [N, G, H, D]; see
    `draft_attention_ref`. The backend is chosen on q's dtype, device and head dim D."""
    if op_backend("draft_attention", q, q.shape[-1], forced=backend) == "triton":
        from kimi_helix.kernels.draft_attention.triton import draft_attention_triton as fn
    else:
        fn = draft_attention_ref
    return fn(q, k_blk, v_blk, k_ctx, v_ctx, slots, lengths, scale)


__all__ = ["draft_attention", "draft_attention_ref"]
