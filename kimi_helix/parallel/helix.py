"""MLA attention under Helix context parallelism, and the paged cache whose pages each cp rank owns.

Per MLA layer and step, on every rank (see docs/helix.md):
1. each new token's latent is written only on its owner rank (`Ownership.write_slots`; -1 elsewhere);
2. the rank's `H / tp` absorbed queries attend its local pages, query t over local keys `[0, kv_bounds[t])` with
   `kv_bounds[t] = local_len(pos_t + 1)`, giving a partial output and fp32 LSE; rows without keys are set to the
   combine identity `(0, -inf)`;
3. one all-to-all over the cp group, split along heads, hands each rank every rank's partials for its
   `H / (tp * cp)` heads, which `combine_partials` merges exactly;
4. `W_UV` maps the merged latent back for those heads; the layer's `o_proj` row shard and all-reduce follow.
The same path serves decode, verify and prefill: per-token bounds make the phase irrelevant to correctness.
"""

from __future__ import annotations

import torch

from ..engine.cache import PageLedger, SequenceBlocks
from ..kernels.mla import combine_partials, mla_decode, sanitize_empty
from ..modeling.batch import ForwardBatch
from ..modeling.config import KimiK3Config
from ..modeling.mla import absorb_query, unabsorb_output
from .distributed import Communicator
from .mapping import Mapping
from .ownership import Ownership


def exchange_and_combine(out: torch.Tensor, lse: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The Helix exchange: out [T, Hq, r] and lse [T, Hq] fp32 of this rank's keys for Hq = H / tp heads ->
    the exact attention over every rank's keys for this rank's head slice, [T, Hq / cp, r] fp32.

    One all-to-all moves, per destination cp rank, the [T, Hq / cp, r + 1] packed partials and LSEs of its heads.
    """
    cp = comm.mapping.cp
    t, hq, r = out.shape
    packed = torch.cat([out.float(), lse[..., None]], dim=-1).view(t, cp, hq // cp, r + 1)
    received = comm.all_to_all_cp(packed.transpose(0, 1))  # [cp (source), T, Hq / cp, r + 1]
    merged, _ = combine_partials(received[..., :r].reshape(cp, -1, r), received[..., r].reshape(cp, -1))
    return merged.view(t, hq // cp, r)


class HelixPageLedger(PageLedger):
    """A `PageLedger` holding only the pages this cp rank owns.

    Admission must be decided identically on every rank, so it is accounted in the pages of cp rank 0, which owns
    the most of any prefix (`local_len(L, 0) >= local_len(L, r)`); each rank then takes only its own pages.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, ownership: Ownership):
        super().__init__(num_pages, page_size, num_slots)
        self.ownership = ownership
        self.reserved: dict[int, int] = {}  # rank-0 pages per admitted sequence: the same on every rank

    def pages_for(self, tokens: int) -> int:
        return -(-self.ownership.local_len(tokens, 0) // self.page_size)

    def can_admit(self, reserve_tokens: int) -> bool:
        return bool(self.free_slots) and self.num_pages - sum(self.reserved.values()) >= self.pages_for(reserve_tokens)

    def admit(self, seq_id: int, reserve_tokens: int) -> SequenceBlocks:
        if not self.can_admit(reserve_tokens):
            raise RuntimeError(f"cannot admit sequence {seq_id}: no free slot or too few free pages")
        blocks = SequenceBlocks(slot=self.free_slots.pop())
        blocks.pages = [self.free_pages.pop() for _ in range(self.ownership.local_pages(reserve_tokens))]
        self.reserved[seq_id] = self.pages_for(reserve_tokens)
        self.seqs[seq_id] = blocks
        return blocks

    def release(self, seq_id: int) -> None:
        del self.reserved[seq_id]
        super().release(seq_id)


class HelixPagedCache:
    """This rank's storage: MLA pages it owns [num_pages, page_size, r + rope] per MLA layer, and the KDA states of
    its `H / (tp * cp)` KDA heads for every sequence (conv [slots, W-1, 3P / world], recurrent [slots, H / world,
    K, K] fp32)."""

    def __init__(self, config: KimiK3Config, ledger: HelixPageLedger, dtype, device, comm: Communicator):
        self.ledger, self.comm, self.mapping = ledger, comm, comm.mapping
        self.fp8 = False
        self.scales: dict[int, torch.Tensor] = {}
        world = self.mapping.world_size
        n, ps, d = ledger.num_pages, ledger.page_size, config.mla_cache_dim
        h, k, w = config.kda_num_heads // world, config.kda_head_dim, config.conv_kernel_size
        self.pages: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for i, kind in enumerate(config.layer_types):
            if kind == "full_attention":
                self.pages[i] = torch.zeros(n, ps, d, dtype=dtype, device=device)
            else:
                self.conv[i] = torch.zeros(ledger.num_slots, w - 1, 3 * h * k, dtype=dtype, device=device)
                self.recurrent[i] = torch.zeros(ledger.num_slots, h, k, k, dtype=torch.float32, device=device)

    def view(self, seq_ids: list[int], backend: str | None = None) -> HelixCacheView:
        return HelixCacheView(self, [self.ledger.seqs[s] for s in seq_ids], backend)

    def reset_state(self, slot: int) -> None:
        for t in (*self.conv.values(), *self.recurrent.values()):
            t[slot].zero_()


class HelixCacheView:
    """The Helix cache as the layers see it for one step (the same calls as `engine.cache.CacheView`)."""

    def __init__(self, cache: HelixPagedCache, blocks: list[SequenceBlocks], backend: str | None = None):
        self.cache, self.blocks, self.backend = cache, blocks, backend
        self.own: Ownership = cache.ledger.ownership
        self.slots = torch.tensor([b.slot for b in blocks], dtype=torch.long)
        self._meta: tuple[ForwardBatch, dict] | None = None

    def step_metadata(self, batch: ForwardBatch, device) -> dict[str, torch.Tensor]:
        """Per-token write slots and key bounds, per-sequence local lengths and the local block table; built once
        per step from the ownership rule and shared by every MLA layer."""
        if self._meta is not None and self._meta[0] is batch:
            return self._meta[1]
        own, positions = self.own, batch.positions.cpu()
        tables = [torch.tensor(b.pages, dtype=torch.long) for b in self.blocks]
        slots = torch.cat([own.write_slots(p, t) for p, t in zip(positions.split(batch.seq_lens), tables)])
        table = torch.zeros(len(self.blocks), max(1, *(len(t) for t in tables)), dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        meta = {
            "write_slots": slots.to(device),
            "kv_bounds": own.kv_bounds(positions).to(device=device, dtype=torch.int32),
            "local_lens": own.local_len(torch.tensor(batch.total_lens())).to(device=device, dtype=torch.int32),
            "block_table": table.to(device),
        }
        self._meta = (batch, meta)
        return meta

    def mla_attention(self, module, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Store owned latents and attend under Helix: q [T, H / tp, nope + rope] -> [T, H / (tp * cp), v_dim]."""
        meta = self.step_metadata(batch, q.device)
        pages = self.cache.pages[module.layer_idx]
        slots = meta["write_slots"]
        mine = slots >= 0
        pages.view(-1, pages.shape[-1])[slots[mine]] = latent[mine].to(pages.dtype)
        w, nope, v_dim = module.kv_b_proj.weight, module.nope, module.v_dim
        q_lat = torch.cat([absorb_query(q[..., :nope], w, nope, v_dim), q[..., nope:]], dim=-1)
        out, lse = mla_decode(
            q_lat.contiguous(),
            pages,
            meta["block_table"],
            meta["local_lens"],
            batch.cu_seqlens,
            module.scale,
            module.kv_lora_rank,
            kv_bounds=meta["kv_bounds"],
            phase="decode" if batch.is_decode else "verify",
            need_lse=True,
            backend=self.backend,
        )
        out, lse = sanitize_empty(out, lse, (meta["kv_bounds"] > 0)[:, None])
        merged = exchange_and_combine(out, lse, self.cache.comm)
        heads = merged.shape[1]
        first = self.cache.mapping.cp_rank * heads * (nope + v_dim)
        return unabsorb_output(merged.to(q.dtype), w[first : first + heads * (nope + v_dim)], nope, v_dim)

    def kda_state(self, layer_idx: int, batch: ForwardBatch, like: torch.Tensor):
        return self.cache.conv[layer_idx], self.cache.recurrent[layer_idx], self.slots.to(like.device)

    def set_kda_state(self, layer_idx: int, batch: ForwardBatch, conv: torch.Tensor, recurrent: torch.Tensor):
        """Nothing to store: the kernels wrote the new states into the pools' slots."""

    def commit(self, batch: ForwardBatch) -> None:
        for blocks, total in zip(self.blocks, batch.total_lens()):
            blocks.length = total


def helix_cache(
    config: KimiK3Config, comm: Communicator, num_pages: int, page_size: int, num_slots: int, dtype, device
):
    """A `HelixPagedCache` for this rank of `comm.mapping` (cp = 1: every page on the one cp rank)."""
    mapping: Mapping = comm.mapping
    mapping.validate(config)
    ledger = HelixPageLedger(num_pages, page_size, num_slots, Ownership(page_size, mapping.cp, mapping.cp_rank))
    return HelixPagedCache(config, ledger, dtype, device, comm)
