"""Paged hybrid cache: MLA latents in fixed-size pages, KDA states in a slot pool.

This module owns storage only (pages, slots, block tables); the attention maths over the pages lives next to the
layer (`modeling/paged_mla.py`).

One `PageLedger` owns every page and every state slot, so later extensions change one place: Helix shards the
ledger (page b of a sequence lives on rank b % cp) and speculative decoding appends 1+k tokens and then truncates
to the accepted length (`rollback`, which returns the pages past it and restores KDA states from the verify step's
per-token states). Pages are reserved at admission and mapped as the cached length grows (`PageLedger`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels.launch import cdiv
from ..kernels.state_restore import restore_verified_states
from ..modeling.batch import ForwardBatch, Phase
from ..modeling.config import KimiK3Config
from ..modeling.paged_mla import FP8, PagedLatents


@dataclass
class VerifyRecord:
    """What one KDA layer saw of one verify group, enough to cut its state back to any prefix of the group.

    context_len: cached tokens before the group. conv_before: [W-1, 3P] the conv state before it. inputs:
    [n, 3P] the group's conv inputs. states: [n, H, K, V] fp32, the recurrent state after each of its tokens.
    scratch_at: where the tensors lie in the cache's verify scratch, the same in every layer (its first token's
    row, its sequence's conv row), or None when they are the kernels' own tensors.
    """

    context_len: int
    conv_before: torch.Tensor
    inputs: torch.Tensor
    states: torch.Tensor
    scratch_at: tuple[int, int] | None = None


@dataclass
class VerifyScratch:
    """One KDA layer's static buffers for verify steps of up to T tokens (so of up to T sequences), or every KDA
    layer's, stacked on a leading layer axis: the kernels (or `CacheView.record_verify`) write a verify step's
    per-token states and conv inputs here, so a CUDA graph replays into the same rows and the records built after
    the step (`CacheView.commit`) are views of them. states: [T, H, K, V] fp32. inputs: [T, 3P]. conv_before:
    [T, W-1, 3P]."""

    states: torch.Tensor
    inputs: torch.Tensor
    conv_before: torch.Tensor


@dataclass
class _VerifyRun:
    """What one KDA layer recorded for one phase run of a pass: the run's sequences in the pass and, in the run's
    packed order, its conv states before, conv inputs and per-token states (scratch rows or the kernel's own)."""

    seqs: slice
    conv_before: torch.Tensor
    inputs: torch.Tensor
    states: torch.Tensor
    scratch_rows: tuple[int, int] | None = None  # (first token row, first sequence row) in the scratch, if there


@dataclass
class SequenceBlocks:
    """A sequence's share of the cache: its state slot, the pages mapped so far in order, its cached length and the
    tokens it reserved at admission.

    row: [pages reserved] int32 host mirror of `pages` (entries past the mapped ones are stale), kept by the
    ledger as a numpy array so that staging a step's block table converts nothing."""

    slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    reserve_tokens: int = 0
    row: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), repr=False)

    def table_row(self) -> np.ndarray:
        """[len(pages)] int32 host page ids: the sequence's block-table row."""
        return self.row[: len(self.pages)]


class PageLedger:
    """Free lists of pages and state slots, and each sequence's `SequenceBlocks`.

    Pages are reserved at admission and mapped as the cached length needs them:
    - `admit` reserves the sequence's worst case, `pages_for(reserve_tokens)` pages, as a count (`reserved_pages`
      sums them over the admitted sequences) and maps none;
    - `map(seq_id, tokens)` takes from the free list the pages covering its first `tokens` tokens, before a step
      writes them (the runner for every step, `CacheView` for a pass outside it); never past the reservation;
    - `truncate` (a rollback) returns the pages wholly past the kept length; the reservation stays, so the next
      tokens map pages again;
    - `release` returns the sequence's pages, slot and reservation.
    Each sequence maps at most the pages it reserved and the reservations sum to at most `num_pages`, so the free
    list always holds every running sequence's unmapped rest: a running sequence never waits for a page.
    `can_admit` therefore counts unreserved pages, not free ones (a free page may be promised to a running
    sequence), and `pages_in_use` counts mapped pages.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.seqs: dict[int, SequenceBlocks] = {}
        self.reserved_pages = 0

    def pages_for(self, tokens: int) -> int:
        """Pages this ledger reserves for a sequence of `tokens` tokens."""
        return cdiv(tokens, self.page_size)

    def can_admit(self, reserve_tokens: int) -> bool:
        return bool(self.free_slots) and self.num_pages - self.reserved_pages >= self.pages_for(reserve_tokens)

    def admit(self, seq_id: int, reserve_tokens: int, map_now: bool = False) -> SequenceBlocks:
        """Give `seq_id` a state slot and reserve every page it can ever need (so a running sequence never waits);
        `map_now` maps them at once (the CUDA graphs' scratch sequence, whose page the padding rows write)."""
        if not self.can_admit(reserve_tokens):
            raise RuntimeError(
                f"cannot admit sequence {seq_id}: no free slot or fewer than "
                f"{self.pages_for(reserve_tokens)} unreserved pages"
            )
        row = np.zeros(cdiv(reserve_tokens, self.page_size), dtype=np.int32)
        blocks = SequenceBlocks(slot=self.free_slots.pop(), reserve_tokens=reserve_tokens, row=row)
        self.seqs[seq_id] = blocks
        self.reserved_pages += self.pages_for(reserve_tokens)
        return self.map(seq_id, reserve_tokens) if map_now else blocks

    def map(self, seq_id: int, tokens: int) -> SequenceBlocks:
        """Map the pages covering the first `tokens` tokens of `seq_id` (those already mapped stay)."""
        blocks = self.seqs[seq_id]
        if tokens > blocks.reserve_tokens:
            raise ValueError(
                f"tokens={tokens} for sequence {seq_id} exceeds the {blocks.reserve_tokens} tokens it reserved"
            )
        have, need = len(blocks.pages), cdiv(tokens, self.page_size)
        if need > have:
            new = self._take(have, need)
            blocks.pages.extend(new)
            blocks.row[have:need] = new
        return blocks

    def truncate(self, seq_id: int, num_keep: int) -> None:
        """Keep the first `num_keep` cached tokens of `seq_id`: its length, and the pages covering them (the pages
        past them go back to the free list; the reservation stays)."""
        blocks = self.seqs[seq_id]
        if not 0 <= num_keep <= blocks.length:
            raise ValueError(f"num_keep must be in [0, {blocks.length}] for sequence {seq_id}, got {num_keep}")
        keep = cdiv(num_keep, self.page_size)
        self._give(blocks.pages[keep:])
        del blocks.pages[keep:]
        blocks.length = num_keep

    def release(self, seq_id: int) -> None:
        blocks = self.seqs.pop(seq_id)
        self._give(blocks.pages)
        self.free_slots.append(blocks.slot)
        self.reserved_pages -= self.pages_for(blocks.reserve_tokens)

    def _take(self, start: int, stop: int) -> list[int]:
        """Page ids for a sequence's pages start .. stop - 1, from the free list."""
        return [self.free_pages.pop() for _ in range(start, stop)]

    def _give(self, pages: list[int]) -> None:
        """Return a sequence's `pages` to the free list (last first, so the next `_take` reuses them in order)."""
        self.free_pages.extend(reversed(pages))

    @property
    def pages_in_use(self) -> int:
        """Mapped pages (reserved but unmapped ones are free)."""
        return self.num_pages - len(self.free_pages)


class PagedCache:
    """Device storage behind a `PageLedger`.

    Per MLA layer: pages [num_pages, page_size, D] with D = kv_lora_rank + rope (fp8 e4m3 pages carry a per-token
    fp32 scale [num_pages, page_size]). Per KDA layer: conv [num_slots, W-1, 3P] in the model dtype and recurrent
    [num_slots, H, K, V] in fp32, views of one tensor over the KDA layers each (so a rollback or reset of a
    slot is one copy for all layers).
    """

    def __init__(self, config: KimiK3Config, ledger: PageLedger, dtype: torch.dtype, device, kv_cache_dtype="auto"):
        if kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {kv_cache_dtype!r}")
        self.ledger = ledger
        self.fp8 = kv_cache_dtype == "fp8_e4m3"
        self.mla_attend = None  # set by Helix: MLA maths across cp ranks (`PagedLatents.attend`)
        n, ps, d = ledger.num_pages, ledger.page_size, config.mla_cache_dim
        h, k, w = config.kda_num_heads, config.kda_head_dim, config.conv_kernel_size
        self.pages: dict[int, torch.Tensor] = {}
        self.scales: dict[int, torch.Tensor] = {}
        for i in filter(config.is_mla_layer, range(config.num_hidden_layers)):
            self.pages[i] = torch.zeros(n, ps, d, dtype=FP8 if self.fp8 else dtype, device=device)
            if self.fp8:
                self.scales[i] = torch.ones(n, ps, dtype=torch.float32, device=device)
        kda = [i for i in range(config.num_hidden_layers) if not config.is_mla_layer(i)]
        slots = ledger.num_slots
        # [L_kda, slots, ...]: one tensor per kind of state; the per-layer pools are its (contiguous) rows
        self.conv_pools = torch.zeros(len(kda), slots, w - 1, 3 * h * k, dtype=dtype, device=device)
        self.recurrent_pools = torch.zeros(len(kda), slots, h, k, k, dtype=torch.float32, device=device)
        self.conv = {i: self.conv_pools[j] for j, i in enumerate(kda)}
        self.recurrent = {i: self.recurrent_pools[j] for j, i in enumerate(kda)}
        # The last step's verify groups, per KDA layer and sequence (sized for that step's verify tokens only).
        self.verify_records: dict[int, dict[int, VerifyRecord]] = {}
        self.verify_scratch: dict[int, VerifyScratch] = {}  # per KDA layer, once `reserve_verify_scratch` ran
        self._scratch_stack: VerifyScratch | None = None  # the same buffers over the stacked layers

    def reserve_verify_scratch(self, max_tokens: int) -> None:
        """Allocate each KDA layer's `VerifyScratch` for verify steps of up to `max_tokens` tokens (once: CUDA
        graphs keep the addresses; asking for more than the first time raises). Its size per token is
        `planner.verify_scratch_bytes_per_token`, which the engine prices before sizing the cache."""
        if self.verify_scratch:
            have = next(iter(self.verify_scratch.values())).states.shape[0]
            if max_tokens > have:
                raise ValueError(f"the verify scratch holds {have} tokens, asked for {max_tokens}")
            return
        if not self.conv:
            return
        layers, conv, state = len(self.conv), self.conv_pools, self.recurrent_pools
        stack = VerifyScratch(
            states=torch.zeros(layers, max_tokens, *state.shape[2:], dtype=state.dtype, device=state.device),
            inputs=torch.zeros(layers, max_tokens, conv.shape[3], dtype=conv.dtype, device=conv.device),
            conv_before=torch.zeros(layers, max_tokens, *conv.shape[2:], dtype=conv.dtype, device=conv.device),
        )
        self._scratch_stack = stack
        for j, i in enumerate(self.conv):
            self.verify_scratch[i] = VerifyScratch(stack.states[j], stack.inputs[j], stack.conv_before[j])

    def block_table(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """[N, width] int32 host ids of the sequences' mapped pages (rows padded with page 0, never read); width
        defaults to the most pages any of them reserved (so it does not change as pages are mapped)."""
        blocks = [self.ledger.seqs[s] for s in seq_ids]
        width = width or max(len(b.row) for b in blocks)
        table = torch.zeros(len(blocks), width, dtype=torch.int32)
        for i, b in enumerate(blocks):
            table[i, : len(b.pages)] = torch.from_numpy(b.table_row())
        return table

    def view(self, seq_ids: list[int], backend: str | None = None) -> CacheView:
        """The cache for passes over `seq_ids` outside the runner (which builds its own addressing): each pass maps
        the pages its tokens need and builds its block table, lengths and token slots on the fly."""
        device = next(iter({**self.pages, **self.conv}.values())).device
        slots = torch.tensor([self.ledger.seqs[s].slot for s in seq_ids], dtype=torch.long)
        return CacheView(self, seq_ids, None, slots.to(device, non_blocking=True), backend=backend)

    def rollback(self, seq_id: int, num_keep: int) -> None:
        """Keep the first `num_keep` cached tokens of `seq_id` (after a verify step accepted fewer than it wrote).

        MLA: the length shrinks and the pages wholly past it (index >= cdiv(num_keep, page_size)) go back to the
        free list (`PageLedger.truncate`; the sequence keeps its reservation, and the next tokens map pages again);
        the dropped slots of the last kept page are overwritten by the next tokens. KDA: the recurrent state
        becomes the one the verify step saved after the last kept token, and the conv state the last W-1 inputs
        up to it (`verify_records`); only the last step's verify group can be cut back, to >= 1 of its tokens."""
        self.rollback_many([(seq_id, num_keep)])

    def rollback_many(self, cuts: Sequence[tuple[int, int]]) -> None:
        """`rollback` of several sequences, cuts [(seq_id, num_keep)], all checked before any is applied. The
        groups recorded in the verify scratch (a graphed or bucketed verify step's) have every KDA layer's states
        cut back in one launch (`kernels.state_restore`, rows from `VerifyRecord.scratch_at`); others layer by
        layer."""
        stacked, own = [], []  # (slot, first row, conv row, kept, group) / (slot, kept, records)
        for seq_id, num_keep in cuts:
            blocks = self.ledger.seqs[seq_id]
            if not 0 <= num_keep <= blocks.length:
                raise ValueError(f"num_keep must be in [0, {blocks.length}] for sequence {seq_id}, got {num_keep}")
            if num_keep == blocks.length or not self.conv:
                continue
            records = [self.verify_records.get(layer, {}).get(seq_id) for layer in self.conv]
            for record in records:
                if record is None or not 1 <= num_keep - record.context_len <= record.inputs.shape[0]:
                    raise ValueError(
                        f"sequence {seq_id}: KDA state can only be cut back inside the last step's verify group "
                        f"(to 1..{'?' if record is None else record.inputs.shape[0]} of its tokens), not to {num_keep}"
                    )
            kept = num_keep - records[0].context_len
            where = {r.scratch_at for r in records}
            if len(where) == 1 and (at := where.pop()) is not None:
                stacked.append((blocks.slot, *at, kept, records[0].inputs.shape[0]))
            else:
                own.append((blocks.slot, kept, records))
        if stacked:
            self._restore_stacked(stacked)
        for slot, kept, records in own:
            for layer, record in zip(self.conv, records):
                conv = self.conv[layer]
                conv[slot].copy_(torch.cat([record.conv_before, record.inputs[:kept]])[-conv.shape[1] :])
                self.recurrent[layer][slot].copy_(record.states[kept - 1])
        for seq_id, num_keep in cuts:
            self.ledger.truncate(seq_id, num_keep)

    def _restore_stacked(self, groups: list[tuple[int, int, int, int, int]]) -> None:
        """Cut back the groups (slot, first scratch row, conv row, kept tokens, group tokens) recorded in the
        verify scratch: their rows, slots and counts go to the device in one copy, then one launch."""
        n, stack = len(groups), self._scratch_stack
        slot, first, seq, kept, group = np.array(groups, dtype=np.int64).T
        host = torch.from_numpy(np.concatenate([np.stack([first, seq], axis=1).ravel(), slot, kept - 1]))
        dev = host.to(self.conv_pools.device, non_blocking=True)
        restore_verified_states(self.recurrent_pools, self.conv_pools, stack.states, stack.inputs,
                                stack.conv_before, dev[2 * n : 3 * n], dev[3 * n :], int(group.max()),
                                dev[: 2 * n].view(n, 2))  # fmt: skip

    def restore_verified(self, slots: torch.Tensor, accepted: torch.Tensor, group: int, backend: str | None = None):
        """Every KDA layer's state of n verify groups of `group` tokens each, cut back on the device to after each
        group's first accepted + 1 tokens (its anchor and accepted drafts), with no host reads (capturable): what
        `rollback` does from host lengths. slots, accepted [n] int64 (device). Group i's records must lie at
        scratch row i * group and conv row i, as a graphed verify step of n groups leaves them. `backend` forces
        the kernel (`kernels.state_restore`)."""
        stack = self._scratch_stack
        if stack is None:
            return
        restore_verified_states(self.recurrent_pools, self.conv_pools, stack.states, stack.inputs,
                                stack.conv_before, slots, accepted, group, backend=backend)  # fmt: skip

    def reset_state(self, slot: int) -> None:
        self.conv_pools[:, slot].zero_()
        self.recurrent_pools[:, slot].zero_()


class CacheView:
    """The cache as the layers see it for one step: the sequences of a `ForwardBatch`, in its order.

    Args:
        cache: the storage.
        seq_ids: the batch's sequences, in its order.
        block_table: [N, max_pages] int32 device page ids per sequence (None: each pass maps the pages its tokens
            need and builds it, with the lengths and token slots).
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
        block_table: torch.Tensor | None,
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
        self._verify_runs: dict[int, list[_VerifyRun]] = {}  # per KDA layer, this pass's runs with verify groups
        self._scratch_used: dict[int, tuple[int, int]] = {}  # per KDA layer: (tokens, sequences) of scratch used
        self._context = None  # (the prefill run's batch, its `prefill_context`) of the last pass

    def _addressing(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # Built once per pass and shared by the layers; a view may serve several passes (as the tests do). The pass's
        # pages are mapped first; lengths, token slots and block table come from the ledger on the host and go over
        # in one copy (nothing waits for it).
        if not self.given and self._batch is not batch:
            ledger, n = self.cache.ledger, batch.num_seqs
            ps, totals = ledger.page_size, batch.total_lens()
            blocks = [ledger.map(s, total) for s, total in zip(self.seq_ids, totals)]
            slots = [
                b.pages[p // ps] * ps + p % ps
                for b, c, m in zip(blocks, batch.context_lens, batch.seq_lens)
                for p in range(c, c + m)
            ]
            table = self.cache.block_table(self.seq_ids)
            packed = torch.cat([torch.tensor(totals + slots, dtype=torch.int64), table.flatten().long()])
            packed = packed.to(self.state_indices.device, non_blocking=True)
            self.cache_seqlens, self.slot_mapping = packed[:n].int(), packed[n : n + len(slots)]
            self.block_table = packed[n + len(slots) :].view(table.shape).int()
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
            attend=self.cache.mla_attend,
            context=self.prefill_context,
        )

    def prefill_context(self, run) -> tuple[torch.Tensor, torch.Tensor]:
        """For a prefill `run` (`PhaseRun`) of this view's pass: (slots [sum totals] int32 or int64, the flat slot
        of every token of its sequences, cached and new; cu_totals [n+1] int32), on the device. Built on the host
        from the ledger's page lists and moved in one copy, once per run: every MLA layer of the pass shares them
        (no device-side index arithmetic, no read-back). A run without cached context has only its new tokens,
        whose slots the runner's buffers hold already: those are used, so a captured prefill reads them too."""
        if self._context is not None and self._context[0] is run.batch:
            return self._context[1]
        if self.given and not any(run.batch.context_lens):  # a fresh prompt's context is its new tokens
            return self.slot_mapping[run.tokens], run.batch.cu_seqlens
        ledger, ps = self.cache.ledger, self.cache.ledger.page_size
        seq_ids = self.seq_ids[run.seqs]
        slots = [
            ledger.seqs[s].row[np.arange(total) // ps] * ps + np.arange(total) % ps
            for s, total in zip(seq_ids, run.batch.total_lens())
        ]
        host = torch.from_numpy(np.concatenate([*slots, run.batch.host_cu_totals.numpy()]).astype(np.int32))
        device = self.state_indices.device
        dev = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
        n = host.shape[0] - run.batch.num_seqs - 1
        self._context = (run.batch, (dev[:n], dev[n:]))
        return self._context[1]

    def kda_state(self, layer_idx: int, batch: ForwardBatch, like: torch.Tensor):
        """The layer's state pools and the batch's slots in them: the kernels update the pools in place. Starts
        the layer's pass: its verify scratch fills from row 0 again."""
        self._verify_runs[layer_idx] = []
        self._scratch_used[layer_idx] = (0, 0)
        return self.cache.conv[layer_idx], self.cache.recurrent[layer_idx], self.state_indices

    def verify_scratch(self, layer_idx: int, num_tokens: int, num_seqs: int = 0) -> VerifyScratch | None:
        """The rows of the layer's static scratch where the next run's records go: states [num_tokens, H, K, V]
        fp32 (`fused_recurrent_kda(..., intermediate_states=...)`), conv inputs [num_tokens, 3P] and the conv
        states before it [num_seqs, W-1, 3P]; the layer writes them there itself (`record_verify` then copies
        nothing). None when the cache has no scratch or it is full (the kernel allocates its own then)."""
        scratch = self.cache.verify_scratch.get(layer_idx)
        used_t, used_n = self._scratch_used.get(layer_idx, (0, 0))
        if scratch is None or used_t + num_tokens > scratch.states.shape[0]:
            return None
        rows, seqs = slice(used_t, used_t + num_tokens), slice(used_n, used_n + num_seqs)
        return VerifyScratch(scratch.states[rows], scratch.inputs[rows], scratch.conv_before[seqs])

    def record_verify(self, layer_idx: int, run, conv_before, inputs, states) -> None:
        """Called by a KDA layer for a run holding verify groups: conv_before [N, W-1, 3P] of the run's sequences,
        inputs [t, 3P] and states [t, H, K, V] in the run's packed token order. They are copied into the layer's
        static scratch when it has room (device copies, captured by a graph; what the layer or its kernel already
        wrote there, `verify_scratch`, is not copied), so the records `commit` builds hold after a graph replay too."""
        scratch = self.cache.verify_scratch.get(layer_idx)
        t, n = states.shape[0], conv_before.shape[0]
        used_t, used_n = self._scratch_used.get(layer_idx, (0, 0))
        if scratch is not None and used_t + t <= scratch.states.shape[0]:  # n <= t: the sequences fit too
            rows, seqs = slice(used_t, used_t + t), slice(used_n, used_n + n)
            pairs = ((states, scratch.states[rows]), (inputs, scratch.inputs[rows]))
            for src, dst in (*pairs, (conv_before, scratch.conv_before[seqs])):
                if src.data_ptr() != dst.data_ptr():  # not written there by the layer already
                    dst.copy_(src)
            conv_before, inputs, states = scratch.conv_before[seqs], scratch.inputs[rows], scratch.states[rows]
            self._scratch_used[layer_idx] = (used_t + t, used_n + n)
            at = (used_t, used_n)
        else:
            at = None
        self._verify_runs.setdefault(layer_idx, []).append(_VerifyRun(run.seqs, conv_before, inputs, states, at))

    def commit(self, batch: ForwardBatch, recorded: CacheView | None = None) -> None:
        """Record each sequence's cached length after the pass, and hand the cache this pass's verify records: per
        KDA layer and verify sequence of `batch`, views of what `recorded` (the view the pass ran with: this one,
        or the one a replayed CUDA graph was captured with) recorded, for `batch`'s sequences and lengths."""
        for seq_id, total in zip(self.seq_ids, batch.total_lens()):
            self.cache.ledger.seqs[seq_id].length = total
        records: dict[int, dict[int, VerifyRecord]] = {}
        for layer, runs in (recorded or self)._verify_runs.items():
            for run in runs:
                records.setdefault(layer, {}).update(self._records(run, batch))
        self.cache.verify_records = {layer: recs for layer, recs in records.items() if recs}

    def _records(self, run: _VerifyRun, batch: ForwardBatch):
        """(sequence id, VerifyRecord) of each verify group of `batch` in the recorded `run`."""
        start = 0
        for i in range(run.seqs.start, min(run.seqs.stop, batch.num_seqs)):
            n, j = batch.seq_lens[i], i - run.seqs.start
            if batch.phases[i] is Phase.VERIFY:
                rows = run.scratch_rows
                at = None if rows is None else (rows[0] + start, rows[1] + j)
                views = (run.conv_before[j], run.inputs[start : start + n], run.states[start : start + n])
                yield self.seq_ids[i], VerifyRecord(batch.context_lens[i], *views, at)
            start += n
