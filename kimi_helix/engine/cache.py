"""Paged hybrid cache: MLA latents in fixed-size pages, KDA states in a slot pool.

This module owns storage only (pages, slots, block tables); the attention maths over the pages lives next to the
layer (`modeling/paged_mla.py`).

One `PageLedger` owns every page and every state slot, so later extensions change one place: Helix shards the
ledger (page b of a sequence lives on rank b % cp) and speculative decoding appends 1+k tokens and then truncates
to the accepted length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.launch import cdiv
from ..modeling.batch import ForwardBatch
from ..modeling.config import KimiK3Config
from ..modeling.paged_mla import FP8, PagedLatents, token_slots


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
        for i, kind in enumerate(config.layer_types):
            if kind == "full_attention":
                self.pages[i] = torch.zeros(n, ps, d, dtype=FP8 if self.fp8 else dtype, device=device)
                if self.fp8:
                    self.scales[i] = torch.ones(n, ps, dtype=torch.float32, device=device)
            else:
                self.conv[i] = torch.zeros(ledger.num_slots, w - 1, 3 * h * k, dtype=dtype, device=device)
                self.recurrent[i] = torch.zeros(ledger.num_slots, h, k, k, dtype=torch.float32, device=device)

    def block_table(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """[N, width] int32 host page ids of the sequences (rows padded with page 0, never read); width defaults to
        the longest row."""
        blocks = [self.ledger.seqs[s] for s in seq_ids]
        width = width or max(len(b.pages) for b in blocks)
        table = torch.zeros(len(blocks), width, dtype=torch.int32)
        for i, b in enumerate(blocks):
            table[i, : len(b.pages)] = torch.tensor(b.pages, dtype=torch.int32)
        return table

    def view(self, seq_ids: list[int], backend: str | None = None) -> CacheView:
        """The cache for one pass over `seq_ids`, addressing built on the fly (the runner builds its own)."""
        device = next(iter({**self.pages, **self.conv}.values())).device
        slots = torch.tensor([self.ledger.seqs[s].slot for s in seq_ids], dtype=torch.long)
        return CacheView(self, seq_ids, self.block_table(seq_ids).to(device), slots.to(device), backend=backend)

    def rollback(self, seq_id: int, num_keep: int) -> None:
        """Keep the first `num_keep` cached tokens of `seq_id` (after a verify step accepted fewer than it wrote).

        MLA: the length shrinks; the dropped slots are overwritten by the next tokens. KDA and conv states cannot
        be cut back from the final state alone: that needs the verify step's per-token states, which the
        speculative decoding work adds; until then dropping tokens of a model with KDA layers raises."""
        blocks = self.ledger.seqs[seq_id]
        if not 0 <= num_keep <= blocks.length:
            raise ValueError(f"num_keep must be in [0, {blocks.length}] for sequence {seq_id}, got {num_keep}")
        if num_keep < blocks.length and self.conv:
            raise NotImplementedError(
                "rolling back KDA state needs the per-token states of the verify step (speculative decoding)"
            )
        blocks.length = num_keep

    def reset_state(self, slot: int) -> None:
        for t in (*self.conv.values(), *self.recurrent.values()):
            t[slot].zero_()


class CacheView:
    """The cache as the layers see it for one step: the sequences of a `ForwardBatch`, in its order.

    Args:
        cache: the storage.
        seq_ids: the batch's sequences, in its order.
        block_table: [N, max_pages] int32 device page ids per sequence.
        state_indices: [N] int64 device KDA slots per sequence.
        cache_seqlens: [N] int32 device cached tokens per sequence after the step (None: from the batch).
        slot_mapping: [T] int64 device flat slot of each new token (None: from the batch and block table).
        backend: the attention backend to force.

    The runner passes views of its preallocated buffers for all four, so a captured step reads them in place.
    """

    def __init__(
        self,
        cache: PagedCache,
        seq_ids: list[int],
        block_table: torch.Tensor,
        state_indices: torch.Tensor,
        cache_seqlens: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        backend: str | None = None,
    ):
        self.cache = cache
        self.seq_ids = list(seq_ids)
        self.block_table = block_table
        self.state_indices = state_indices
        self.given = cache_seqlens is not None and slot_mapping is not None
        self.cache_seqlens = cache_seqlens
        self.slot_mapping = slot_mapping
        self.backend = backend
        self._batch: ForwardBatch | None = None

    def _addressing(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # Built once per pass and shared by the layers; a view may serve several passes (as the tests do).
        if not self.given and self._batch is not batch:
            device = self.block_table.device
            self.cache_seqlens = torch.tensor(batch.total_lens(), dtype=torch.int32, device=device)
            self.slot_mapping = token_slots(self.block_table, batch, self.cache.ledger.page_size)
            self._batch = batch
        return self.cache_seqlens, self.slot_mapping

    def mla_latents(self, layer_idx: int, batch: ForwardBatch, like: torch.Tensor) -> PagedLatents:
        """This layer's pages (and fp8 scales) with the step's block table, lengths and token slots."""
        cache_seqlens, slot_mapping = self._addressing(batch)
        return PagedLatents(
            pages=self.cache.pages[layer_idx],
            scales=self.cache.scales.get(layer_idx),
            block_table=self.block_table,
            cache_seqlens=cache_seqlens,
            slot_mapping=slot_mapping,
            backend=self.backend,
        )

    def kda_state(self, layer_idx: int, batch: ForwardBatch, like: torch.Tensor):
        """The layer's state pools and the batch's slots in them: the kernels update the pools in place."""
        return self.cache.conv[layer_idx], self.cache.recurrent[layer_idx], self.state_indices

    def commit(self, batch: ForwardBatch) -> None:
        """Record each sequence's cached length after the pass."""
        for seq_id, total in zip(self.seq_ids, batch.total_lens()):
            self.cache.ledger.seqs[seq_id].length = total
