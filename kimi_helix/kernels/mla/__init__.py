"""MLA attention ops, dispatched through the backend switch (`kernels/backends.py`).

`mla_decode` serves decode and speculative verify: absorbed queries over the paged latent cache.
`mla_prefill` serves prefill: expanded queries, keys and values, varlen with a cached prefix.
Both return (out, lse); lse is None only from backends that declare `returns_lse=False` (never when asked).
"""

from __future__ import annotations

import torch

from ..backends import AttentionRequest, dtype_name, select
from .combine import combine_partials, combine_partials_ref, sanitize_empty  # noqa: F401 (public op)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    kv_bounds: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    *,
    phase: str = "decode",
    need_lse: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA over a paged cache: q [T, H, D] -> out [T, H, kv_lora_rank], lse [T, H].

    See `naive.mla_decode_ref` for the full contract. `phase` is "decode" (one query per sequence) or "verify"
    (several); `backend` forces one ("torch", "triton"); None chooses automatically.
    """
    request = AttentionRequest(
        phase=phase,
        num_heads=q.shape[1],
        head_dim=q.shape[2],
        v_head_dim=kv_lora_rank,
        q_dtype=dtype_name(q.dtype),
        kv_dtype=dtype_name(kv_cache.dtype),
        device=q.device.type,
        need_lse=need_lse,
        need_kv_bounds=kv_bounds is not None,
    )
    name = select(request, backend)
    args = (q, kv_cache, block_table, cache_seqlens, cu_seqlens_q, scale, kv_lora_rank, kv_bounds, kv_scale)
    if name == "triton":
        from .decode import mla_decode_triton

        return mla_decode_triton(*args)
    from .naive import mla_decode_ref

    return mla_decode_ref(*args)


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    *,
    need_lse: bool = False,
    host_offsets: tuple | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expanded MLA prefill: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] -> out [Tq, H, Dv], lse [Tq, H] or None.

    See `naive.mla_prefill_ref` for the contract. `host_offsets`, the host's (cu_seqlens_q, cu_seqlens_k), spares
    every backend reading the device offsets back (a device sync); they are checked instead of the device ones.
    """
    request = AttentionRequest(
        phase="prefill",
        num_heads=q.shape[1],
        head_dim=q.shape[2],
        v_head_dim=v.shape[2],
        q_dtype=dtype_name(q.dtype),
        kv_dtype=dtype_name(k.dtype),
        device=q.device.type,
        need_lse=need_lse,
    )
    name = select(request, backend)
    if name == "triton":
        from .prefill import mla_prefill_triton as fn
    elif name == "sdpa":
        from .sdpa import mla_prefill_sdpa as fn
    else:
        from .naive import mla_prefill_ref as fn
    return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, host_offsets)
