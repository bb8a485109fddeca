"""Pure-PyTorch MLA attention references: the correctness oracles (fp32 maths) for the Triton kernels."""

from __future__ import annotations

import torch


def _gather_latents(kv_cache, kv_scale, pages, length):
    """Sequence latents [length, D] in fp32 from its page list (dequantised with the per-token scale for fp8)."""
    page_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    page, offset = pages.long()[pos // page_size], pos % page_size
    latents = kv_cache[page, offset].float()
    if kv_scale is not None:
        latents = latents * kv_scale[page, offset].float()[:, None]
    return latents


def mla_decode_ref(
    q, kv_cache, block_table, cache_seqlens, cu_seqlens_q, scale, kv_lora_rank, kv_bounds=None, kv_scale=None
):
    """Weight-absorbed MLA (MQA over the latent) of T query tokens over a paged latent cache.

    Args:
        q: [T, H, D] queries (absorbed q_nope in latent space, then q_pe), sequences packed end to end.
        kv_cache: [P, page_size, D] latent pages ([c, k_pe], D = kv_lora_rank + rope): fp32/fp16/bf16, or
            float8_e4m3fn together with kv_scale.
        block_table: [N, max_pages] int32; token p of sequence i lives in page block_table[i, p // page_size].
        cache_seqlens: [N] int32 cached tokens per sequence, its new tokens included (already written).
        cu_seqlens_q: [N + 1] int32 query offsets (s_q may differ per sequence).
        scale: softmax scale ((qk_nope + qk_rope) ** -0.5, not D ** -0.5).
        kv_lora_rank: values are the first kv_lora_rank latent dims.
        kv_bounds: optional [T] int32; query t sees keys [0, kv_bounds[t]) (clamped to the sequence length),
            overriding the causal rule (query j of s_q sees keys [0, cache_seqlens[i] - s_q + j]).
        kv_scale: [P, page_size] fp32 per-token dequantisation scale of an fp8 cache.

    Returns:
        out [T, H, kv_lora_rank] in q.dtype and lse [T, H] fp32 (natural log); a query that sees no key gets a zero
        row and lse -inf.
    """
    if q.dim() != 3 or kv_cache.dim() != 3 or q.shape[2] != kv_cache.shape[2]:
        raise ValueError(
            f"q [T, H, D] and kv_cache [P, page_size, D] disagree: {list(q.shape)}, {list(kv_cache.shape)}"
        )
    if not 0 < kv_lora_rank <= q.shape[2]:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must lie in [1, D={q.shape[2]}]")
    if (kv_scale is not None) != (kv_cache.dtype == torch.float8_e4m3fn):
        raise ValueError("kv_scale must be given exactly when kv_cache is float8_e4m3fn")
    T, H, _ = q.shape
    out = torch.zeros(T, H, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), cache_seqlens.tolist()
    if len(cu) != block_table.shape[0] + 1 or cu[0] != 0 or cu[-1] != T or len(lens) != block_table.shape[0]:
        raise ValueError(
            f"cu_seqlens_q {cu} / cache_seqlens {lens} do not describe T={T} tokens over "
            f"N={block_table.shape[0]} sequences"
        )
    for i, length in enumerate(lens):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        latents = _gather_latents(kv_cache, kv_scale, block_table[i], length)  # [L, D]
        if kv_bounds is None:
            bound = length - (hi - lo) + 1 + torch.arange(hi - lo, device=q.device)
        else:
            bound = kv_bounds[lo:hi].long()
        visible = torch.arange(length, device=q.device)[None, :] < bound.clamp(0, length)[:, None]  # [s_q, L]
        scores = torch.einsum("thd,ld->thl", q[lo:hi].float(), latents) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)  # [s_q, H]
        # A query with no visible key has lse -inf; nan_to_num turns its exp(-inf - -inf) into a zero row.
        probs = torch.exp(scores - seq_lse[..., None]).nan_to_num(0.0)
        out[lo:hi] = probs @ latents[:, :kv_lora_rank]
        lse[lo:hi] = seq_lse
    return out.to(q.dtype), lse


def host_bounds(cu_seqlens_q, cu_seqlens_k, host_offsets=None) -> tuple[list[int], list[int]]:
    """The query and key offsets as Python ints: `host_offsets` (the host's copies, no device read) when given."""
    if host_offsets is None:
        return cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [x.tolist() if isinstance(x, torch.Tensor) else [int(i) for i in x] for x in host_offsets]


def mla_prefill_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, host_offsets=None):
    """Varlen causal attention of new tokens over their sequence's cached prefix plus themselves (expanded MLA).

    Args:
        q: [Tq, H, Dqk] queries, all sequences packed end to end (fp32/fp16/bf16).
        k: [Tk, H, Dqk] keys, packed likewise.
        v: [Tk, H, Dv] values.
        cu_seqlens_q: [N + 1] int32 query offsets; cu_seqlens_k: [N + 1] int32 key offsets.
            Sequence i's queries are the LAST Tq_i of its Tk_i positions: query j sees keys [0, Tk_i - Tq_i + j].
        scale: softmax scale ((qk_nope + qk_rope) ** -0.5 for MLA).
        host_offsets: (cu_seqlens_q, cu_seqlens_k) as the host knows them (sequences of ints or CPU tensors):
            read instead of the device offsets, which then are not read back (no device sync); they must agree.

    Returns:
        out [Tq, H, Dv] in q.dtype and lse [Tq, H] fp32 natural-log logsumexp of the scaled scores
        (-inf, with a zero output row, for a query that sees no key).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-d [T, H, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {list(cu_seqlens_q.shape)} and cu_seqlens_k {list(cu_seqlens_k.shape)} differ")
    H = q.shape[1]
    out = torch.zeros(q.shape[0], H, v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], H), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = host_bounds(cu_seqlens_q, cu_seqlens_k, host_offsets)
    for i in range(len(cq) - 1):
        tq, tk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if tq == 0:
            continue
        qs = q[cq[i] : cq[i + 1]].float()
        ks, vs = k[ck[i] : ck[i + 1]].float(), v[ck[i] : ck[i + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        visible = torch.arange(tk, device=q.device)[None, :] <= (tk - tq + torch.arange(tq, device=q.device))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)  # [H, tq]
        # A row with no visible key has lse -inf; nan_to_num turns its exp(-inf - -inf) into a zero output.
        probs = torch.exp(scores - seq_lse[..., None]).nan_to_num(0.0)
        out[cq[i] : cq[i + 1]] = torch.einsum("hqk,khd->qhd", probs, vs)
        lse[cq[i] : cq[i + 1]] = seq_lse.transpose(0, 1)
    return out.to(q.dtype), lse
