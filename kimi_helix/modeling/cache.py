"""`KimiK3Cache`: the per-request cache of the HF `generate()` path.

It stores exactly what the engine's paged cache stores (the MLA latent per token, the KDA conv and recurrent
states per sequence) behind the same calls the layers make: `mla_attention`, `kda_state` and `set_kda_state`.
Rows are the batch rows of `generate()`; left padding is never stored, so rows may hold
contexts of different lengths.
"""

from __future__ import annotations

import torch

from .batch import ForwardBatch
from .config import KimiK3Config
from .mla import attend_contexts


class KimiK3Cache:
    """Hybrid cache for `batch_size` sequences.

    Per MLA layer: a list of latents [L_b, kv_lora_rank + rope] per row. Per KDA layer: conv state
    [B, W-1, 3P] (in the model dtype) and recurrent state [B, H, K, V] (fp32). Storage is allocated on first use,
    on the device and dtype of the activations.
    """

    is_compileable = False

    def __init__(self, config: KimiK3Config, batch_size: int):
        self.config = config
        self.batch_size = batch_size
        self.seq_lens = [0] * batch_size
        self.latents: dict[int, list[torch.Tensor]] = {}
        self.conv_states: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}

    @property
    def is_linear(self) -> list[bool]:
        return [not self.config.is_mla_layer(i) for i in range(self.config.num_hidden_layers)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Longest cached row (the HF convention for a batch)."""
        return max(self.seq_lens, default=0)

    def _check_batch(self, batch: ForwardBatch) -> None:
        if batch.num_seqs != self.batch_size or batch.context_lens != self.seq_lens:
            raise ValueError(
                f"KimiK3Cache holds {self.batch_size} rows with lengths {self.seq_lens}, but the forward pass "
                f"continues {batch.num_seqs} rows from lengths {batch.context_lens}"
            )

    def append_mla(self, layer_idx: int, latent: torch.Tensor, batch: ForwardBatch) -> list[torch.Tensor]:
        """Store new latents [T, D] (packed per `batch`) and return each row's full context [L_b, D]."""
        self._check_batch(batch)
        rows = self.latents.get(layer_idx)
        if rows is None:
            rows = [latent.new_empty(0, latent.shape[-1]) for _ in range(self.batch_size)]
        rows = [torch.cat([old, new]) for old, new in zip(rows, latent.split(batch.seq_lens))]
        self.latents[layer_idx] = rows
        return rows

    def mla_attention(self, module, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Store the new latents and attend with the torch reference: q [T, H, nope + rope] -> [T, H, v_dim]."""
        return attend_contexts(module, q, self.append_mla(module.layer_idx, latent, batch), batch)

    def kda_state(self, layer_idx: int, batch: ForwardBatch, like: torch.Tensor):
        """This layer's (conv [B, W-1, 3P], recurrent [B, H, K, V] fp32, None) states, one per row (so no slot
        indices); zeros for a new row. The conv state takes the dtype and device of `like`, the activations."""
        self._check_batch(batch)
        if layer_idx not in self.recurrent_states:
            c = self.config
            h, k, w = c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size
            self.conv_states[layer_idx] = like.new_zeros(self.batch_size, w - 1, 3 * h * k)
            self.recurrent_states[layer_idx] = torch.zeros(
                self.batch_size, h, k, k, dtype=torch.float32, device=like.device
            )
        return self.conv_states[layer_idx], self.recurrent_states[layer_idx], None

    def set_kda_state(self, layer_idx: int, batch: ForwardBatch, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv_states[layer_idx] = conv
        self.recurrent_states[layer_idx] = recurrent

    def commit(self, batch: ForwardBatch) -> None:
        """Account for the tokens of a finished forward pass."""
        self.seq_lens = batch.total_lens()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder rows for beam search."""
        idx = beam_idx.tolist()
        self.seq_lens = [self.seq_lens[i] for i in idx]
        self.latents = {layer: [rows[i] for i in idx] for layer, rows in self.latents.items()}
        self.conv_states = {layer: s[beam_idx.to(s.device)] for layer, s in self.conv_states.items()}
        self.recurrent_states = {layer: s[beam_idx.to(s.device)] for layer, s in self.recurrent_states.items()}
