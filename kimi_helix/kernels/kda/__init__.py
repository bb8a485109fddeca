"""Kimi Delta Attention (KDA) ops, dispatched by the op switch.

`kda_chunk` (prefill) and `kda_recurrent` (decode / speculative verify) pick the torch references
(`naive_chunk_kda`, `naive_recurrent_kda`) or the Triton kernels (`chunk.chunk_kda`,
`fused_recurrent.fused_recurrent_kda`) from their declared capabilities; the contracts are the references'.
"""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.kda.naive import kda_gate, l2norm, naive_chunk_kda, naive_recurrent_kda


def kda_chunk(q, k, v, g, beta, *, backend=None, **kwargs):
    """Chunked KDA over q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K], beta [B, T, H]; see `naive_chunk_kda`."""
    if op_backend("kda_chunk", q, q.shape[-1], forced=backend) == "triton":
        from kimi_helix.kernels.kda.chunk import chunk_kda as fn
    else:
        fn = naive_chunk_kda
    return fn(q, k, v, g, beta, **kwargs)


def kda_recurrent(q, k, v, g, beta, *, backend=None, **kwargs):
    """Token-by-token KDA (decode, verify); see `naive_recurrent_kda`."""
    if op_backend("kda_recurrent", q, q.shape[-1], forced=backend) == "triton":
        from kimi_helix.kernels.kda.fused_recurrent import fused_recurrent_kda as fn
    else:
        fn = naive_recurrent_kda
    return fn(q, k, v, g, beta, **kwargs)


__all__ = ["kda_chunk", "kda_gate", "kda_recurrent", "l2norm", "naive_chunk_kda", "naive_recurrent_kda"]
