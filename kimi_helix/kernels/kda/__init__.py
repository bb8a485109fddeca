"""Kimi Delta Attention (KDA) ops, dispatched by the backend switch.

`chunk_kda` (prefill) and `fused_recurrent_kda` (decode / speculative verify) pick the torch references
(`naive_chunk_kda`, `naive_recurrent_kda`) or the Triton kernels (`chunk.chunk_kda_triton`,
`fused_recurrent.fused_recurrent_kda_triton`) from their declared capabilities; the contracts are the references'.
`backend` forces one ("torch", "triton"); None chooses automatically.
"""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.kda.naive import kda_gate, l2norm, naive_chunk_kda, naive_recurrent_kda


def chunk_kda(q, k, v, g, beta, *, backend=None, **kwargs):
    """Chunked KDA over q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K], beta [B, T, H]; see `naive_chunk_kda`."""
    if op_backend("chunk_kda", q, q.shape[-1], forced=backend) == "triton":
        from kimi_helix.kernels.kda.chunk import chunk_kda_triton as fn
    else:
        fn = naive_chunk_kda
    return fn(q, k, v, g, beta, **kwargs)


def fused_recurrent_kda(q, k, v, g, beta, *, backend=None, **kwargs):
    """Token-by-token KDA (decode, verify); see `naive_recurrent_kda`."""
    if op_backend("fused_recurrent_kda", q, q.shape[-1], forced=backend) == "triton":
        from kimi_helix.kernels.kda.fused_recurrent import fused_recurrent_kda_triton as fn
    else:
        fn = naive_recurrent_kda
    return fn(q, k, v, g, beta, **kwargs)


__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_gate", "l2norm", "naive_chunk_kda", "naive_recurrent_kda"]
