"""`KimiK3Cache`: the per-request cache of the HF `generate()` path.

It stores exactly what the engine's paged cache stores (the MLA latent per token, the KDA conv and recurrent
states per sequence) behind the same calls the layers make: `mla_latents` and `kda_state`. Each batch row owns one
page that grows (by powers of two) with its context, and one state slot, so the layers run the same paged maths
and the same state-pool kernels as in the engine. Left padding is never stored, so rows may hold contexts of
different lengths.
"""

from __future__ import annotations

import torch

from .batch import ForwardBatch
from .config import KimiK3Config
from .paged_mla import PagedLatents, token_slots

MIN_PAGE = 64  # smallest per-row page; pages double from here so the page size (a kernel constant) rarely changes


class KimiK3Cache:
    """Hybrid cache for `batch_size` sequences.

    Per MLA layer: pages [B, page_size, kv_lora_rank + rope], page b holding row b's latents. Per KDA layer: conv
    state [B, W-1, 3P] (in the model dtype) and recurrent state [B, H, K, V] (fp32), slot b for row b. Storage is
    allocated on first use, on the device and dtype of the activations.
    """

    is_compileable = False

    def __init__(self, config: KimiK3Config, batch_size: int):
        self.config = config
        self.batch_size = batch_size
        self.seq_lens = [0] * batch_size
        self.pages: dict[int, torch.Tensor] = {}
        self.conv_states: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}
        self._addressing: tuple | None = None

    @property
    def is_linear(self) -> list[bool]:
        return [t == "linear_attention" for t in self.config.layer_types]

    @property
    def latents(self) -> dict[int, list[torch.Tensor]]:
        """Per MLA layer, each row's cached latents [L_b, kv_lora_rank + rope] (views into the pages)."""
        return {layer: [p[b, :n] for b, n in enumerate(self.seq_lens)] for layer, p in self.pages.items()}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Longest cached row (the HF convention for a batch)."""
        return max(self.seq_lens, default=0)

    def _check_batch(self, batch: ForwardBatch) -> None:
        if batch.num_seqs != self.batch_size or batch.context_lens != self.seq_lens:
            raise ValueError(
                f"KimiK3Cache holds {self.batch_size} rows with lengths {self.seq_lens}, but the forward pass "
                f"continues {batch.num_seqs} rows from lengths {batch.context_lens}"
            )

    def mla_latents(self, layer_idx: int, batch: ForwardBatch, like: torch.Tensor) -> PagedLatents:
        """This layer's pages, grown to hold the batch's new tokens, and the step's addressing into them."""
        self._check_batch(batch)
        need = max(batch.total_lens(), default=0)
        pages = self.pages.get(layer_idx)
        size = MIN_PAGE if pages is None else pages.shape[1]
        while size < need:
            size *= 2
        if pages is None or pages.shape[1] < size:
            grown = like.new_zeros(self.batch_size, size, like.shape[-1])
            if pages is not None:
                grown[:, : pages.shape[1]] = pages
            self.pages[layer_idx] = pages = grown
        if self._addressing is None or self._addressing[0] is not batch or self._addressing[1] != size:
            rows = torch.arange(self.batch_size, dtype=torch.int32, device=like.device)[:, None]
            lens = torch.tensor(batch.total_lens(), dtype=torch.int32, device=like.device)
            self._addressing = (batch, size, rows, lens, token_slots(rows, batch, size))  # shared by the layers
        _, _, rows, lens, slots = self._addressing
        return PagedLatents(pages=pages, scales=None, block_table=rows, cache_seqlens=lens, slot_mapping=slots)

    def kda_state(self, layer_idx: int, batch: ForwardBatch, like: torch.Tensor):
        """This layer's state pools (conv [B, W-1, 3P] in the dtype of `like`, recurrent [B, H, K, V] fp32) and the
        batch's slots in them (row b uses slot b); zeros for a new row. The kernels update the pools in place."""
        self._check_batch(batch)
        if layer_idx not in self.recurrent_states:
            c = self.config
            h, k, w = c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size
            self.conv_states[layer_idx] = like.new_zeros(self.batch_size, w - 1, 3 * h * k)
            self.recurrent_states[layer_idx] = torch.zeros(
                self.batch_size, h, k, k, dtype=torch.float32, device=like.device
            )
        slots = torch.arange(self.batch_size, device=like.device)
        return self.conv_states[layer_idx], self.recurrent_states[layer_idx], slots

    def commit(self, batch: ForwardBatch) -> None:
        """Account for the tokens of a finished forward pass."""
        self.seq_lens = batch.total_lens()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder rows for beam search."""
        idx = beam_idx.tolist()
        self.seq_lens = [self.seq_lens[i] for i in idx]
        self.pages = {layer: p[beam_idx.to(p.device)] for layer, p in self.pages.items()}
        self.conv_states = {layer: s[beam_idx.to(s.device)] for layer, s in self.conv_states.items()}
        self.recurrent_states = {layer: s[beam_idx.to(s.device)] for layer, s in self.recurrent_states.items()}
