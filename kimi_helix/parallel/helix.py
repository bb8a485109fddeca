"""MLA attention under Helix context parallelism, and the paged cache whose pages each cp rank owns.

Per MLA layer and step, on every rank (see docs/helix.md):
1. each new token's latent is written only on its owner rank (write slot -1 elsewhere);
2. the rank's `H / tp` absorbed queries attend its local pages, query t over local keys `[0, kv_bounds[t])` with
   `kv_bounds[t] = local_len(pos_t + 1)`, giving a partial output and fp32 LSE; rows without keys are set to the
   combine identity `(0, -inf)`;
3. one all-to-all over the cp group, split along heads, hands each rank every rank's partials for its
   `H / (tp * cp)` heads, which `combine_partials` merges exactly;
4. `W_UV` maps the merged latent back for those heads; the layer's `o_proj` row shard and all-reduce follow.
The same path serves decode, verify and prefill: per-token bounds make the phase irrelevant to correctness.

The cache keeps the engine's addressing: a sequence's page list is indexed by *global* page, holding this rank's
page id where it owns the page and -1 where another rank does, so the runner's block table and slots need no
change; `Ownership` turns them into local tables, lengths, bounds and write slots.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..engine.cache import PagedCache, PageLedger
from ..kernels.mla import combine_partials, mla_decode, sanitize_empty
from ..modeling.batch import ForwardBatch, Phase
from ..modeling.config import FULL_ATTENTION, KimiK3Config
from ..modeling.paged_mla import PagedLatents, absorb_query, store_latents, unabsorb_output
from .distributed import Communicator
from .ownership import Ownership

NOT_HERE = -1  # page-list entry of a page another cp rank owns


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


def step_bytes(
    config: KimiK3Config, tp: int, cp: int, tokens: int, logit_rows: int, sampled: int, itemsize: int, rank: int = 0
) -> dict[str, int]:
    """docs/helix.md's formula: bytes `rank` sends to its peers in one engine step, by collective kind.

    tokens: the step's new tokens (T); logit_rows: rows of the lm_head output (R); sampled: token ids rank 0
    broadcasts (s); itemsize: activation bytes (b). No term depends on the context length.
    """
    world = tp * cp
    if world == 1:
        return {}
    mla_layers = config.layer_types.count(FULL_ATTENTION)
    out = {
        "all_reduce": (1 + 2 * config.num_hidden_layers) * tokens * config.hidden_size * itemsize,
        "all_gather": logit_rows * config.vocab_size // world * itemsize * (world - 1),
    }
    if cp > 1:  # fp32 partials and LSE of H / tp heads, all but this rank's own share
        heads = config.num_attention_heads // tp
        out["all_to_all"] = mla_layers * tokens * heads * (config.kv_lora_rank + 1) * 4 * (cp - 1) // cp
    if rank == 0 and sampled:
        out["broadcast"] = 8 * sampled
    return out


class HelixAttention:
    """`PagedLatents.attend` for one rank: the Helix path of every MLA layer (module docstring, steps 1-4)."""

    def __init__(self, ownership: Ownership, comm: Communicator):
        self.own, self.comm = ownership, comm
        self._meta: tuple | None = None  # (batch, block table, metadata) of the step being run

    def metadata(self, batch: ForwardBatch, kv: PagedLatents) -> dict[str, torch.Tensor]:
        """Write slots [T], key bounds [T], local lengths [N] and local block table [N, *] of the step, all from
        the ownership rule; built once per step and shared by the MLA layers."""
        if self._meta is not None and self._meta[0] is batch and self._meta[1] is kv.block_table:
            return self._meta[2]
        positions = batch.positions.to(kv.block_table.device)
        meta = {
            "write_slots": self.own.write_slots(positions, kv.slot_mapping),
            "kv_bounds": self.own.kv_bounds(positions).to(torch.int32),
            "local_lens": self.own.local_len(kv.cache_seqlens).to(torch.int32),
            "block_table": self.own.local_block_table(kv.block_table).contiguous(),
        }
        self._meta = (batch, kv.block_table, meta)
        return meta

    def __call__(self, module, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch, kv: PagedLatents):
        """q [T, H / tp, nope + rope], latent [T, r + rope] -> [T, H / (tp * cp), v_dim]."""
        meta = self.metadata(batch, kv)
        mine = meta["write_slots"] >= 0
        store_latents(dataclasses.replace(kv, slot_mapping=meta["write_slots"][mine]), latent[mine])
        w, nope, v_dim = module.kv_b_proj.weight, module.nope, module.v_dim
        q_lat = torch.cat([absorb_query(q[..., :nope], w, nope, v_dim), q[..., nope:]], dim=-1)
        out, lse = mla_decode(
            q_lat.contiguous(),
            kv.pages,
            meta["block_table"],
            meta["local_lens"],
            batch.cu_seqlens,
            module.scale,
            module.kv_lora_rank,
            kv_bounds=meta["kv_bounds"],
            kv_scale=kv.scales,
            phase="decode" if all(p is Phase.DECODE for p in batch.phases) else "verify",
            need_lse=True,
            backend=kv.backend,
        )
        out, lse = sanitize_empty(out, lse, (meta["kv_bounds"] > 0)[:, None])
        merged = exchange_and_combine(out, lse, self.comm)
        heads = merged.shape[1]
        first = self.comm.mapping.cp_rank * heads * (nope + v_dim)
        return unabsorb_output(merged.to(q.dtype), w[first : first + heads * (nope + v_dim)], nope, v_dim)


class HelixPageLedger(PageLedger):
    """A `PageLedger` holding only the pages this cp rank owns.

    Admission must be decided identically on every rank, so reservations are counted in the pages of cp rank 0,
    which owns the most of any prefix (`local_len(L, 0) >= local_len(L, r)`): every rank then maps at most its
    reservation, and the base ledger's accounting holds on each. `map` takes only this rank's pages. A sequence's
    page list is indexed by global page, with `NOT_HERE` where another rank owns the page.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, ownership: Ownership):
        super().__init__(num_pages, page_size, num_slots)
        self.ownership = ownership

    def pages_for(self, tokens: int) -> int:
        return self.ownership.local_pages(tokens, 0)

    def _take(self, start: int, stop: int) -> list[int]:
        owned = set(self.ownership.owned_pages(stop, start))
        return [self.free_pages.pop() if b in owned else NOT_HERE for b in range(start, stop)]

    def _give(self, pages: list[int]) -> None:
        self.free_pages.extend(p for p in reversed(pages) if p != NOT_HERE)


class HelixPagedCache(PagedCache):
    """This rank's storage: the MLA pages it owns, and the KDA states of its `H / (tp * cp)` KDA heads for every
    sequence; MLA layers attend through `HelixAttention`."""

    def __init__(self, config: KimiK3Config, ledger: HelixPageLedger, dtype, device, comm: Communicator, **kw):
        world = comm.mapping.world_size
        comm.mapping.validate(config)
        local = copy.copy(config)  # the state pools hold this rank's share of the KDA heads
        local.linear_attn_config = {**config.linear_attn_config, "num_heads": config.kda_num_heads // world}
        super().__init__(local, ledger, dtype, device, **kw)
        self.comm = comm
        self.mla_attend = HelixAttention(ledger.ownership, comm)


def helix_cache(
    config: KimiK3Config, comm: Communicator, num_pages: int, page_size: int, num_slots: int, dtype, device, **kw
):
    """A `HelixPagedCache` for this rank of `comm.mapping` (cp = 1: every page on the one cp rank); `kw` as for
    `PagedCache` (kv_cache_dtype)."""
    m = comm.mapping
    ledger = HelixPageLedger(num_pages, page_size, num_slots, Ownership(page_size, m.cp, m.cp_rank))
    return HelixPagedCache(config, ledger, dtype, device, comm, **kw)
