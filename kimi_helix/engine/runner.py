"""`ModelRunner`: one scheduled step in, logits at the requested positions out.

The runner owns one preallocated staging buffer for every per-step input (token ids, positions, cu_seqlens, the
block table, cache lengths, token slots, KDA state slots and the logit row index; `StepBuffers`). `prepare` fills
its pinned host copy from the scheduler's host-side step and moves it in one asynchronous copy, so preparing a step
never waits for the device; `forward` reads only the device buffer, so a decode or verify step of a fixed batch
shape always sees the same tensors and can be captured once and replayed.

Logit rows per scheduled request (`RunnerOutput.rows`): its last token for a decode or a final prefill chunk, every
token of a verify group (row i = the distribution after token i of the group), every token of a prefill chunk when
the request asks for `prompt_logprobs`, and none for an intermediate prefill chunk otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..modeling.batch import ForwardBatch, Phase
from .cache import CacheView, PagedCache
from .scheduler import ScheduledStep

# The token id padding rows feed (any valid id; its output is never sampled).
PAD_TOKEN_ID = 0
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


@dataclass
class RunnerOutput:
    """logits: [R, V] fp32 at the requested rows. rows: per scheduled request, its rows of `logits`."""

    logits: torch.Tensor
    rows: list[slice]


@dataclass
class StepInputs:
    """A prepared step: views of the runner's buffers, the batch layout and the cache view the layers read."""

    input_ids: torch.Tensor  # [T] int64
    batch: ForwardBatch
    view: CacheView
    logits_index: torch.Tensor  # [R] int64 packed token index of each logit row


@dataclass(frozen=True)
class Padding:
    """Rows a graphed step appends after the live ones to fill its shape: `batch` sequences of `tokens_per_seq`
    new tokens in all. The appended sequences hold only their own tokens, at the first slots of `page`, and share
    the state `slot`, so they never address a live sequence's page or state."""

    batch: int
    tokens_per_seq: int
    page: int
    slot: int

    @property
    def shape(self) -> tuple[int, int]:
        """(sequences, tokens) of the padded step."""
        return self.batch, self.batch * self.tokens_per_seq


@dataclass(frozen=True)
class PrefillPadding:
    """Rows a graphed prefill appends after its one live sequence (a whole prompt, the last row's logits) to fill
    `tokens` rows: staged as a second sequence on `page` and state `slot` (`modeling.batch.TailPadding` says how
    the layers keep them out of the live sequence's states)."""

    tokens: int
    page: int
    slot: int

    @property
    def shape(self) -> tuple[int, int]:
        """(sequences, tokens) of the padded step: the live sequence and the padding's."""
        return 2, self.tokens


@dataclass
class StepFields:
    """The per-step inputs, as views of one staging buffer at a step shape's offsets: torch tensors of the device
    buffer, or numpy arrays of the pinned host buffer (`StepBuffers.host_fields`)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    state_indices: torch.Tensor  # [N] int64
    cu_seqlens: torch.Tensor  # [N + 1] int32
    cache_seqlens: torch.Tensor  # [N] int32
    block_table: torch.Tensor  # [N, max_pages] int32
    logits_index: torch.Tensor  # [R] int64, last: the offsets of the others do not depend on R


class StepBuffers:
    """One device byte buffer holding every per-step input, mirrored by one pinned host buffer.

    A step's fields are packed back to back at offsets fixed by its shape (tokens T, sequences N; the logit rows R
    come last), so `prepare` writes them on the host and `upload` moves the whole step in ONE asynchronous copy,
    and every step of one shape reads the same device addresses (what a CUDA graph replays)."""

    _SPECS = (  # (field, size: "T" tokens / "N" sequences / "N+1" / "NW" block table / "R" rows, dtype)
        ("input_ids", "T", torch.int64),
        ("positions", "T", torch.int64),
        ("slot_mapping", "T", torch.int64),
        ("state_indices", "N", torch.int64),
        ("cu_seqlens", "N+1", torch.int32),
        ("cache_seqlens", "N", torch.int32),
        ("block_table", "NW", torch.int32),
        ("logits_index", "R", torch.int64),
    )

    def __init__(self, max_seqs: int, max_tokens: int, max_pages: int, device):
        self.max_seqs, self.max_tokens, self.max_pages = max_seqs, max_tokens, max_pages
        self.device = torch.device(device)
        self._layouts: dict[tuple[int, int, int], tuple] = {}
        self._device_fields: dict[tuple[int, int, int], StepFields] = {}
        self._host_fields: dict[tuple[int, int, int], StepFields] = {}
        nbytes = self._end(max_tokens, max_seqs, max_tokens)
        self.device_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.host_bytes = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        # the host side is staged through numpy views: a write costs about a microsecond, a torch op several, and a
        # decode step's staging is a few dozen small writes on the critical path between two steps
        self._host_np = self.host_bytes.numpy()
        self._uploaded = None  # CUDA event after the last upload: the host buffer is reused only once it is done

    def _offsets(self, t: int, n: int, r: int):
        sizes = {"T": t, "N": n, "N+1": n + 1, "NW": n * self.max_pages, "R": r}
        offset = 0
        for name, size, dtype in self._SPECS:
            count = sizes[size]
            yield name, offset, count, dtype
            offset += -(-count * dtype.itemsize // 8) * 8  # every field 8-byte aligned

    def _layout(self, t: int, n: int, r: int) -> tuple:
        """(name, offset, count, dtype) of every field for a step shape, cached (a few shapes recur every step)."""
        key = (t, n, r)
        layout = self._layouts.get(key)
        if layout is None:
            if t > self.max_tokens or n > self.max_seqs or r > self.max_tokens:
                raise ValueError(f"a step of {t} tokens, {n} sequences, {r} rows exceeds the runner's buffers "
                                 f"({self.max_tokens} tokens, {self.max_seqs} sequences)")  # fmt: skip
            if len(self._layouts) >= 1024:  # prefill shapes vary; keep the cache bounded
                self._layouts.clear()
                self._device_fields.clear()
                self._host_fields.clear()
            layout = self._layouts[key] = tuple(self._offsets(t, n, r))
        return layout

    def _end(self, t: int, n: int, r: int) -> int:
        _, offset, count, dtype = self._layout(t, n, r)[-1]
        return offset + count * dtype.itemsize

    def fields(self, t: int, n: int, r: int) -> StepFields:
        """Views of the device buffer for a step of `t` tokens, `n` sequences and `r` logit rows."""
        key = (t, n, r)
        cached = self._device_fields.get(key)
        if cached is None:
            views = {
                name: self.device_bytes[offset : offset + count * dtype.itemsize].view(dtype)
                for name, offset, count, dtype in self._layout(t, n, r)
            }
            views["block_table"] = views["block_table"].view(n, self.max_pages)
            cached = self._device_fields[key] = StepFields(**views)
        return cached

    def host_fields(self, t: int, n: int, r: int) -> StepFields:
        """Numpy views of the pinned host buffer to fill, once the previous upload has left it (normally long done)."""
        if self._uploaded is not None and not self._uploaded.query():
            self._uploaded.synchronize()
        key = (t, n, r)
        cached = self._host_fields.get(key)
        if cached is None:
            host = self._host_np
            views = {
                name: host[offset : offset + count * dtype.itemsize].view(_NUMPY[dtype])
                for name, offset, count, dtype in self._layout(t, n, r)
            }
            views["block_table"] = views["block_table"].reshape(n, self.max_pages)
            cached = self._host_fields[key] = StepFields(**views)
        return cached

    def upload(self, t: int, n: int, r: int) -> None:
        """Copy the step's bytes to the device in one non-blocking copy from pinned memory."""
        end = self._end(t, n, r)
        self.device_bytes[:end].copy_(self.host_bytes[:end], non_blocking=True)
        if self.device.type == "cuda":
            self._uploaded = self._uploaded or torch.cuda.Event()
            self._uploaded.record()


class ModelRunner:
    """Runs `model` (a `KimiK3ForCausalLM`) on the paged `cache`.

    Args:
        model, cache, device: the model, its paged cache and their device.
        max_num_seqs: sequences per step at most. max_num_tokens: new tokens per step at most.
        max_pages_per_seq: block-table width (pages of the longest sequence the engine admits).
        attention_backend: MLA backend to force (None: automatic).
    """

    def __init__(
        self,
        model,
        cache: PagedCache,
        device,
        *,
        max_num_seqs: int,
        max_num_tokens: int,
        max_pages_per_seq: int,
        attention_backend: str | None = None,
    ):
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.attention_backend = attention_backend
        self.max_num_seqs = max_num_seqs
        # a graphed prefill stages its padding as a second sequence (`PrefillPadding`), also when max_num_seqs = 1
        self.buffers = StepBuffers(max(max_num_seqs, 2), max_num_tokens, max_pages_per_seq, self.device)
        # `cuda_graph.StepGraphs` over this runner, set by the engine on CUDA: replays uniform decode/verify steps
        self.graphs = None
        # called as input_patch(step, input_ids [T] device) once a step's inputs are uploaded and before its forward:
        # the speculative decoder writes drafts that are still on the device into their verify rows
        self.input_patch = None

    def run(self, step: ScheduledStep) -> RunnerOutput:
        """Prepare the inputs, run the forward pass, return the logits at the requested rows; commit lengths."""
        if self.graphs is not None:
            out = self.graphs.run(step)
            if out is not None:
                return out
        inputs, rows = self.prepare(step)
        with torch.no_grad():
            logits = self.forward(inputs)
        inputs.view.commit(inputs.batch)
        return RunnerOutput(logits, rows)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Embeddings -> layers -> final norm -> lm_head at `inputs.logits_index`: [R, V] fp32.

        Reads only `inputs` (views of the static buffers) and the model and cache tensors."""
        model = self.model.model
        hidden = model.forward_packed(model.embed_tokens(inputs.input_ids), inputs.batch, inputs.view)
        return self.model.lm_head(hidden[inputs.logits_index]).float()

    def prepare(
        self, step: ScheduledStep, padding: Padding | PrefillPadding | None = None
    ) -> tuple[StepInputs, list[slice]]:
        """Fill the buffers for `step` (and `padding`'s rows after it) and return views of the live part plus each
        request's logit rows. Host work only, then one asynchronous copy: nothing here waits for the device."""
        reqs, n_live, t_live = step.requests, len(step.requests), step.total_tokens
        n, t = (n_live, t_live) if padding is None else padding.shape
        contexts = [r.num_computed for r in reqs]
        rows, index = [], []
        start = 0
        for r, phase, ctx, m in zip(reqs, step.phases, contexts, step.num_tokens):
            wanted = self.logit_tokens(r, phase, ctx, m)
            rows.append(slice(len(index), len(index) + len(wanted)))
            index.extend(range(start + wanted.start, start + wanted.stop))
            start += m
        if isinstance(padding, PrefillPadding) and not reqs:  # a capture's step: one row, as the live ones have
            index = [t - 1]
        host = self.buffers.host_fields(t, n, len(index))
        self._stage_live(host, step, contexts, 0 if padding is None else padding.page)
        host.logits_index[:] = index
        if isinstance(padding, PrefillPadding):
            self._stage_prefill_padding(host, padding, n_live, t_live)
        elif padding is not None:
            self._stage_padding(host, padding, n_live)
        self.buffers.upload(t, n, len(index))
        dev = self.buffers.fields(t, n, len(index))
        if self.input_patch is not None and n_live:
            self.input_patch(step, dev.input_ids[:t_live])
        batch = ForwardBatch(
            seq_lens=step.num_tokens,
            context_lens=contexts,
            cu_seqlens=dev.cu_seqlens[: n_live + 1],
            positions=dev.positions[:t_live],
            phases=list(step.phases),
        )
        view = CacheView(
            self.cache,
            [r.request_id for r in reqs],
            dev.block_table[:n_live],
            dev.state_indices[:n_live],
            cache_seqlens=dev.cache_seqlens[:n_live],
            slot_mapping=dev.slot_mapping[:t_live],
            backend=self.attention_backend,
        )
        return StepInputs(dev.input_ids[:t_live], batch, view, dev.logits_index), rows

    def _stage_live(self, host: StepFields, step: ScheduledStep, contexts: list[int], spare_page: int) -> None:
        """Write the scheduled sequences' rows of every field into the host views (vectorised over tokens); the
        block table's entries past each sequence's pages hold `spare_page`."""
        n, t, ps = len(step.requests), step.total_tokens, self.cache.ledger.page_size
        lens = np.array(step.num_tokens, dtype=np.int64)
        ctx = np.array(contexts, dtype=np.int64)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        host.cu_seqlens[: n + 1] = cu
        host.cache_seqlens[:n] = ctx + lens
        ledger = self.cache.ledger
        blocks = [ledger.map(r.request_id, c + m) for r, c, m in zip(step.requests, contexts, step.num_tokens)]
        host.state_indices[:n] = [b.slot for b in blocks]
        table = host.block_table[:n]
        # Unused entries: the kernels stop at each sequence's length. A graphed step passes its scratch page, where
        # a round staged on the device (speculative.async_rounds) writes the drafts past a sequence's reservation.
        table.fill(spare_page)
        for row, b in zip(table, blocks):
            pages = b.table_row()
            row[: pages.shape[0]] = pages
        host.input_ids[:t] = [tok for ids in step.token_ids for tok in ids]
        seq = np.repeat(np.arange(n), lens)
        positions = np.arange(t) - cu[:-1][seq] + ctx[seq]
        host.positions[:t] = positions
        host.slot_mapping[:t] = table[seq, positions // ps].astype(np.int64) * ps + positions % ps

    def _stage_padding(self, host: StepFields, padding: Padding, n_live: int) -> None:
        """Rows n_live.. of `padding`'s shape: sequences of only their own new tokens on the padding page/slot."""
        q, n, ps = padding.tokens_per_seq, padding.batch, self.cache.ledger.page_size
        t0 = n_live * q
        within = np.arange(n * q - t0) % q
        host.input_ids[t0:] = PAD_TOKEN_ID
        host.positions[t0:] = within
        host.slot_mapping[t0:] = padding.page * ps + within
        host.cu_seqlens[n_live + 1 :] = np.arange(n_live + 1, n + 1) * q
        host.cache_seqlens[n_live:] = q
        host.state_indices[n_live:] = padding.slot
        host.block_table[n_live:] = padding.page

    def _stage_prefill_padding(self, host: StepFields, padding: PrefillPadding, n_live: int, t_live: int) -> None:
        """Rows t_live.. of a padded prefill: a second sequence of the padding tokens on the padding page/slot (and,
        for a capture's step without a live sequence, an empty first one there too)."""
        ps, rows = self.cache.ledger.page_size, padding.tokens - t_live
        within = np.arange(rows) % ps
        host.input_ids[t_live:] = PAD_TOKEN_ID
        host.positions[t_live:] = within
        host.slot_mapping[t_live:] = padding.page * ps + within
        host.cu_seqlens[1:] = t_live, padding.tokens
        host.cache_seqlens[1], host.state_indices[1], host.block_table[1] = rows, padding.slot, padding.page
        if n_live == 0:
            host.cache_seqlens[0], host.state_indices[0], host.block_table[0] = 0, padding.slot, padding.page

    @staticmethod
    def logit_tokens(request, phase: Phase, context: int, n: int) -> range:
        """Which of the request's `n` new tokens need logits (indices into its tokens)."""
        if phase is not Phase.PREFILL:
            return range(n)  # a decode's token, or every token of a verify group
        if request.params.prompt_logprobs is not None:
            return range(n)
        return range(n - 1, n) if context + n == len(request.prompt_ids) else range(0)
