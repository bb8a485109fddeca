"""Paged hybrid cache: MLA latents in fixed-size pages, KDA states in a slot pool.

One `PageLedger` owns every page and every state slot, so later extensions change one place: Helix shards the
ledger (page b of a sequence lives on rank b % cp) and speculative decoding appends 1+k tokens and then truncates
to the accepted length.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..kernels.launch import cdiv
from ..kernels.mla import mla_decode, mla_prefill
from ..modeling.batch import ForwardBatch
from ..modeling.config import KimiK3Config
from ..modeling.mla import absorb_query, unabsorb_output

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


@dataclass
class SequenceBlocks:
    """A sequence's share of the cache: its page ids in order, its state slot and cached length."""

    slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0


class PageLedger:
    """Free lists of pages and state slots, and each sequence's `SequenceBlocks`."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.seqs: dict[int, SequenceBlocks] = {}

    def pages_for(self, tokens: int) -> int:
        return cdiv(tokens, self.page_size)

    def can_admit(self, reserve_tokens: int) -> bool:
        return bool(self.free_slots) and len(self.free_pages) >= self.pages_for(reserve_tokens)

    def admit(self, seq_id: int, reserve_tokens: int) -> SequenceBlocks:
        """Give `seq_id` a state slot and every page it can ever need (so a running sequence never waits)."""
        if not self.can_admit(reserve_tokens):
            raise RuntimeError(
                f"cannot admit sequence {seq_id}: no free slot or fewer than "
                f"{self.pages_for(reserve_tokens)} free pages"
            )
        blocks = SequenceBlocks(slot=self.free_slots.pop())
        blocks.pages = [self.free_pages.pop() for _ in range(self.pages_for(reserve_tokens))]
        self.seqs[seq_id] = blocks
        return blocks

    def release(self, seq_id: int) -> None:
        blocks = self.seqs.pop(seq_id)
        self.free_pages.extend(reversed(blocks.pages))
        self.free_slots.append(blocks.slot)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)


class PagedCache:
    """Device storage behind a `PageLedger`.

    Per MLA layer: pages [num_pages, page_size, D] with D = kv_lora_rank + rope (fp8 e4m3 pages carry a per-token
    fp32 scale [num_pages, page_size]). Per KDA layer: conv [num_slots, W-1, 3P] in the model dtype and recurrent
    [num_slots, H, K, V] in fp32.
    """

    def __init__(self, config: KimiK3Config, ledger: PageLedger, dtype: torch.dtype, device, kv_cache_dtype="auto"):
        if kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {kv_cache_dtype!r}")
        self.ledger = ledger
        self.fp8 = kv_cache_dtype == "fp8_e4m3"
        n, ps, d = ledger.num_pages, ledger.page_size, config.mla_cache_dim
        h, k, w = config.kda_num_heads, config.kda_head_dim, config.conv_kernel_size
        self.pages: dict[int, torch.Tensor] = {}
        self.scales: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for i in range(config.num_hidden_layers):
            if config.is_mla_layer(i):
                self.pages[i] = torch.zeros(n, ps, d, dtype=FP8 if self.fp8 else dtype, device=device)
                if self.fp8:
                    self.scales[i] = torch.ones(n, ps, dtype=torch.float32, device=device)
            else:
                self.conv[i] = torch.zeros(ledger.num_slots, w - 1, 3 * h * k, dtype=dtype, device=device)
                self.recurrent[i] = torch.zeros(ledger.num_slots, h, k, k, dtype=torch.float32, device=device)

    def view(self, seq_ids: list[int], backend: str | None = None) -> CacheView:
        return CacheView(self, [self.ledger.seqs[s] for s in seq_ids], backend)

    def reset_state(self, slot: int) -> None:
        for t in (*self.conv.values(), *self.recurrent.values()):
            t[slot].zero_()


class CacheView:
    """The cache as the layers see it for one step: the sequences of a `ForwardBatch`, in its order.

    Every MLA call goes through the attention backend switch: decode through `mla_decode` over the pages (absorbed
    form), prefill through `mla_prefill` (expanded form over the gathered context).
    """

    def __init__(self, cache: PagedCache, blocks: list[SequenceBlocks], backend: str | None = None):
        self.cache = cache
        self.blocks = blocks
        self.backend = backend
        self.slots = torch.tensor([b.slot for b in blocks], dtype=torch.long)
        self._block_table: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._index: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._index_batch: ForwardBatch | None = None

    def _token_index(self, batch: ForwardBatch, device, whole_context: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of every new token (or of every context token), packed in batch order; built once per
        step and shared by every MLA layer."""
        if self._index_batch is not batch:  # a view may serve several passes (as the tests do); indices are per pass
            self._index, self._index_batch = {}, batch
        key = ("context" if whole_context else "new", str(device))
        if key not in self._index:
            ps, pages, offsets = self.cache.ledger.page_size, [], []
            for blocks, start, n in zip(self.blocks, batch.context_lens, batch.seq_lens):
                pos = torch.arange(0 if whole_context else start, start + n)
                pages.append(torch.tensor(blocks.pages, dtype=torch.long)[pos // ps])
                offsets.append(pos % ps)
            self._index[key] = (torch.cat(pages).to(device), torch.cat(offsets).to(device))
        return self._index[key]

    def write_latents(self, layer_idx: int, latent: torch.Tensor, batch: ForwardBatch) -> None:
        """Store new latents [T, D] (packed per `batch`) at each sequence's next positions; fp8 quantises here."""
        pages = self.cache.pages[layer_idx]
        page, offset = self._token_index(batch, pages.device, whole_context=False)
        if self.cache.fp8:
            scale = latent.float().abs().amax(-1).clamp_min(1e-12) / FP8_MAX
            pages[page, offset] = (latent.float() / scale[:, None]).to(FP8)
            self.cache.scales[layer_idx][page, offset] = scale
        else:
            pages[page, offset] = latent.to(pages.dtype)

    def _read_packed(self, layer_idx: int, batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor:
        """Every sequence's whole context, packed: [sum L_i, D], dequantised to `dtype`."""
        pages = self.cache.pages[layer_idx]
        page, offset = self._token_index(batch, pages.device, whole_context=True)
        ctx = pages[page, offset]
        if self.cache.fp8:
            ctx = ctx.float() * self.cache.scales[layer_idx][page, offset][:, None]
        return ctx.to(dtype)

    def read_latents(self, layer_idx: int, batch: ForwardBatch, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each sequence's whole context [L_i, D], dequantised to `dtype`."""
        return list(self._read_packed(layer_idx, batch, dtype).split(batch.total_lens()))

    def block_table(self, device) -> torch.Tensor:
        """[N, max_pages] int32 page ids of the batch's sequences (rows padded with page 0, never read); built once
        per step and shared by every MLA layer."""
        if self._block_table is None:
            width = max(len(b.pages) for b in self.blocks)
            table = torch.zeros(len(self.blocks), width, dtype=torch.int32)
            for i, b in enumerate(self.blocks):
                table[i, : len(b.pages)] = torch.tensor(b.pages, dtype=torch.int32)
            self._block_table = table.to(device)
        return self._block_table

    def mla_attention(self, module, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Store the new latents and attend: q [T, H, nope + rope] -> [T, H, v_dim]."""
        self.write_latents(module.layer_idx, latent, batch)
        w, nope, v_dim, r = module.kv_b_proj.weight, module.nope, module.v_dim, module.kv_lora_rank
        device = q.device
        if batch.is_decode:
            q_lat = torch.cat([absorb_query(q[..., :nope], w, nope, v_dim), q[..., nope:]], dim=-1)
            out, _ = mla_decode(
                q_lat.contiguous(),
                self.cache.pages[module.layer_idx],
                self.block_table(device),
                torch.tensor(batch.total_lens(), dtype=torch.int32, device=device),
                batch.cu_seqlens,
                module.scale,
                r,
                kv_scale=self.cache.scales.get(module.layer_idx),
                backend=self.backend,
            )
            return unabsorb_output(out, w, nope, v_dim)
        contexts = self._read_packed(module.layer_idx, batch, q.dtype)
        kv = torch.nn.functional.linear(contexts[:, :r], w).view(contexts.shape[0], -1, nope + v_dim)
        k_pe = contexts[:, None, r:].expand(-1, kv.shape[1], -1)
        k = torch.cat([kv[..., :nope], k_pe], dim=-1)
        cu_k = torch.tensor([0, *itertools.accumulate(batch.total_lens())], dtype=torch.int32, device=device)
        out, _ = mla_prefill(
            q.contiguous(), k, kv[..., nope:].contiguous(), batch.cu_seqlens, cu_k, module.scale, backend=self.backend
        )
        return out

    def kda_state(self, layer_idx: int, batch: ForwardBatch, like: torch.Tensor):
        """The layer's state pools and the batch's slots in them: the kernels update the pools in place."""
        if self._slots is None or self._slots.device != like.device:
            self._slots = self.slots.to(like.device)
        return self.cache.conv[layer_idx], self.cache.recurrent[layer_idx], self._slots

    def set_kda_state(self, layer_idx: int, batch: ForwardBatch, conv: torch.Tensor, recurrent: torch.Tensor):
        """Nothing to store: the kernels wrote the new states into the pools' slots."""

    def commit(self, batch: ForwardBatch) -> None:
        for blocks, total in zip(self.blocks, batch.total_lens()):
            blocks.length = total
