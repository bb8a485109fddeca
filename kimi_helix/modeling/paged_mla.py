"""MLA attention over a paged latent cache, per declared phase.

Both caches (the HF path's `KimiK3Cache` and the engine's `PagedCache`) hand the layer the same `PagedLatents`:
pages of latents `[c, k_pe]` and, for this step, a block table, each sequence's cached length and each new
token's slot. The maths lives here, next to the layer; the caches only own storage.

- Decode and verify sequences take `mla_decode`: absorbed queries (MQA over the latent) straight from the pages.
  A verify group of 1 + k tokens is causal inside itself: query j of a sequence with s_q new tokens sees keys
  `[0, cache_seqlens - s_q + j]` (the kernel's default rule; `kv_bounds` would override it).
- Prefill chunks take `mla_prefill`: the context is gathered from the pages and expanded once for all queries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.mla import mla_decode, mla_prefill
from .batch import ForwardBatch, PhaseRun

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


@dataclass
class PagedLatents:
    """One MLA layer's latent storage and this step's addressing into it.

    Attributes:
        pages: [P, page_size, D] latents, D = kv_lora_rank + rope (float8_e4m3fn together with `scales`).
        scales: [P, page_size] fp32 per-token dequantisation scales of an fp8 cache, else None.
        block_table: [N, max_pages] int32; token p of sequence i lives in page block_table[i, p // page_size].
        cache_seqlens: [N] int32 cached tokens per sequence including this step's new ones.
        slot_mapping: [T] int64 flat slot (page * page_size + offset) of each new token, in packed order.
        backend: the attention backend to force (None: automatic).
        attend: replaces the maths below when set (Helix context parallelism, `parallel/helix.py`): called as
            `attend(module, q, latent, batch, kv)`, it stores and attends itself.
        context: called as `context(run)` for a prefill run, gives (slots [sum totals] int32 of every token of its
            sequences, cached and new; cu_totals [n+1] int32), both on the device, from the host's page lists
            (`engine.cache.CacheView.prefill_context`: one upload per pass). None: built on the device here.
    """

    pages: torch.Tensor
    scales: torch.Tensor | None
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    slot_mapping: torch.Tensor
    backend: str | None = None
    attend: Callable | None = None
    context: Callable | None = None

    @property
    def page_size(self) -> int:
        return self.pages.shape[1]


def absorb_query(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, nope: int, v_dim: int) -> torch.Tensor:
    """Map `q_nope` [T, H, nope] into the latent space: [T, H, r] (`q_nope @ W_UK` per head)."""
    h = q_nope.shape[1]
    w = kv_b_weight.view(h, nope + v_dim, -1)
    return torch.einsum("thd,hdr->thr", q_nope, w[:, :nope])


def unabsorb_output(o_latent: torch.Tensor, kv_b_weight: torch.Tensor, nope: int, v_dim: int) -> torch.Tensor:
    """Map the latent attention output [T, H, r] to per-head values [T, H, v_dim] (`o @ W_UV^T`)."""
    h = o_latent.shape[1]
    w = kv_b_weight.view(h, nope + v_dim, -1)
    return torch.einsum("thr,hvr->thv", o_latent, w[:, nope:])


def token_slots(block_table: torch.Tensor, batch: ForwardBatch, page_size: int) -> torch.Tensor:
    """[T] int64 flat slots of the batch's new tokens (device ops; the engine's runner fills its own buffer)."""
    lens = torch.tensor(batch.seq_lens, device=block_table.device)
    seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=block_table.device), lens)
    pos = batch.positions.to(block_table.device)
    return block_table[seq, pos // page_size].long() * page_size + pos % page_size


def store_latents(kv: PagedLatents, latent: torch.Tensor) -> None:
    """Write new latents [T, D] into their slots; an fp8 cache stores `latent / scale` with scale = amax / 448."""
    flat = kv.pages.view(-1, kv.pages.shape[-1])
    if kv.scales is not None:
        scale = latent.float().abs().amax(-1).clamp_min(1e-12) / FP8_MAX
        flat[kv.slot_mapping] = (latent.float() / scale[:, None]).to(FP8)
        kv.scales.view(-1)[kv.slot_mapping] = scale
    else:
        flat[kv.slot_mapping] = latent.to(flat.dtype)


def gather_context(kv: PagedLatents, block_table: torch.Tensor, totals: list[int], dtype: torch.dtype):
    """The whole cached context of the sequences of `block_table` [n, max_pages] with `totals` tokens each (new
    ones included), packed: [sum totals, D] in `dtype`. Built on the device without a host sync."""
    return gather_latents(kv, context_slots(block_table, totals, kv.page_size), dtype)


def context_slots(block_table: torch.Tensor, totals: list[int], page_size: int) -> torch.Tensor:
    """[sum totals] int64 flat slots of every token of the sequences of `block_table` [n, max_pages], `totals`
    tokens each (device ops; `output_size` spares `repeat_interleave` its read-back of the lengths)."""
    device, size = block_table.device, int(sum(totals))
    lens = torch.tensor(totals).to(device, non_blocking=True)
    seq = torch.repeat_interleave(torch.arange(len(totals), device=device), lens, output_size=size)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(size, device=device) - starts[seq]
    return block_table[seq, pos // page_size].long() * page_size + pos % page_size


def gather_latents(kv: PagedLatents, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The latents at flat `slots` [S] (int32 or int64) of the pages, dequantised: [S, D] in `dtype`."""
    ctx = kv.pages.view(-1, kv.pages.shape[-1]).index_select(0, slots)
    if kv.scales is not None:
        ctx = ctx.float() * kv.scales.view(-1).index_select(0, slots)[:, None]
    return ctx.to(dtype)


def paged_mla_attention(module, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch, kv: PagedLatents):
    """Store the new latents, then attend per phase run: q [T, H, nope + rope] -> [T, H, v_dim].

    `module` is the `MLAttention` layer (its `kv_b_proj` weight, head dims and softmax scale).
    """
    if kv.attend is not None:
        return kv.attend(module, q, latent, batch, kv)
    store_latents(kv, latent)
    runs = batch.runs()
    outs = [(_decode if run.decode_path else _prefill)(module, q[run.tokens], run, kv) for run in runs]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _decode(module, q: torch.Tensor, run: PhaseRun, kv: PagedLatents) -> torch.Tensor:
    """Absorbed MLA of decode / verify queries over the pages."""
    w, nope, v_dim = module.kv_b_proj.weight, module.nope, module.v_dim
    q_lat = torch.cat([absorb_query(q[..., :nope], w, nope, v_dim), q[..., nope:]], dim=-1)
    out, _ = mla_decode(
        q_lat.contiguous(),
        kv.pages,
        kv.block_table[run.seqs],
        kv.cache_seqlens[run.seqs],
        run.batch.cu_seqlens,
        module.scale,
        module.kv_lora_rank,
        kv_scale=kv.scales,
        phase=run.attention_phase,
        backend=kv.backend,
    )
    return unabsorb_output(out, w, nope, v_dim)


def _prefill(module, q: torch.Tensor, run: PhaseRun, kv: PagedLatents) -> torch.Tensor:
    """Expanded MLA of prefill chunks over their gathered contexts (no host sync: the kernel takes the host's
    offsets, and the context's slots come from the host's page lists where the cache gives them)."""
    w, nope, v_dim, r = module.kv_b_proj.weight, module.nope, module.v_dim, module.kv_lora_rank
    host_cu_k = run.batch.host_cu_totals
    if kv.context is not None:
        slots, cu_k = kv.context(run)
    else:
        slots = context_slots(kv.block_table[run.seqs], run.batch.total_lens(), kv.page_size)
        cu_k = host_cu_k.to(q.device, non_blocking=True)
    contexts = gather_latents(kv, slots, q.dtype)
    kv_full = F.linear(contexts[:, :r], w).view(contexts.shape[0], -1, nope + v_dim)
    k_pe = contexts[:, None, r:].expand(-1, kv_full.shape[1], -1)
    k = torch.cat([kv_full[..., :nope], k_pe], dim=-1)
    out, _ = mla_prefill(
        q.contiguous(),
        k,
        kv_full[..., nope:].contiguous(),
        run.batch.cu_seqlens,
        cu_k,
        module.scale,
        host_offsets=(run.batch.host_cu_seqlens, host_cu_k),
        backend=kv.backend,
    )
    return out
