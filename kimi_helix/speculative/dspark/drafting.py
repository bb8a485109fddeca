"""What `DSparkProposer` drafts with at serving time: a static per-slot context cache and CUDA graphs of the
greedy draft forward.

At the demo model's size a drafting round is all launch and host overhead, so nothing here loops over requests
or tokens in Python, and nothing reads a device value on the host except the one copy of the drafts:

- `ContextCache`: per drafter layer, the injected context keys and values [slots, capacity, H, hd] of every
  request, written in place at their positions (`write`) and cropped by a host-side length only (rollback sets
  the length). The drafter's attention reads the rows in place, bounded by the lengths on the device. It grows
  by doubling when a request needs more room, which bumps `generation` (the graphs recapture then: they read the
  old tensors).
- `DraftGraphs`: the greedy draft forward (backbone, head, Markov chain, confidence) captured
  per (batch bucket, drafts); its static inputs are the anchor ids, anchor positions (= context lengths) and
  slot indices, and its output packs tokens and confidences in one tensor, read with one copy. It also captures
  the context write of a step's features (`ContextCache.write`) per token count, for features that sit in a
  static buffer (the engine's `TargetFeatureCapture`), with the tokens' (slot, position) as static input, and
  a greedy round's advance (`advance_and_draft`: the verify step's context write, the device's acceptance, the
  next draft) per batch, drafts and the addresses of its inputs.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from .model import Draft, DSparkDrafter, SlotContext

logger = logging.getLogger(__name__)


class PinnedUpload:
    """A small int64 host-to-device staging pair: `put` writes rows into pinned memory and moves them in one
    asynchronous copy into a device tensor of fixed address (a graph's static input). It waits for its previous
    copy before reusing the host buffer. The host side is written through a numpy view: a round's few small
    writes then cost microseconds each, where torch ops on the host cost several (they sit between the syncs
    of every drafting round)."""

    def __init__(self, rows: int, cols: int, device: torch.device):
        self.device = device
        self.dev = torch.zeros(rows, cols, dtype=torch.int64, device=device)
        self.host = torch.zeros(rows, cols, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host = self.host.numpy()
        self._done = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def put(self, values, cols: int | None = None) -> torch.Tensor:
        """values [rows, n] int64 (a numpy array, nested lists or a host tensor) -> the device view [rows, cols or n]
        (columns n.. zeroed)."""
        values = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values, dtype=np.int64)
        n = values.shape[1]
        cols = n if cols is None else cols
        if self._pending and not self._done.query():
            self._done.synchronize()
        self._host[:, :n] = values
        self._host[:, n:cols] = 0
        self.dev[:, :cols].copy_(self.host[:, :cols], non_blocking=True)
        if self._done is not None:
            self._done.record()
            self._pending = True
        return self.dev[:, :cols]


class PinnedDownload:
    """A device-to-host int64 copy that does not wait: `fetch` queues it into pinned memory and records an event;
    `result` waits for that event only, not for the work queued after it (a round's next draft), and returns the
    host values as a numpy array of the fetched shape."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = torch.empty(0, dtype=torch.int64)
        self._done = torch.cuda.Event() if device.type == "cuda" else None
        self._shape: tuple[int, ...] = ()

    def fetch(self, values: torch.Tensor) -> None:
        if self._done is not None:
            self._done.synchronize()  # the previous fetch's copy, before its buffer is reused
        n = values.numel()
        if self.host.numel() < n:
            self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=torch.int64, pin_memory=self._done is not None)
        self.host[:n].copy_(values.reshape(-1), non_blocking=True)
        if self._done is not None:
            self._done.record()
        self._shape = tuple(values.shape)

    def result(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
        return self.host[: int(np.prod(self._shape))].numpy().reshape(self._shape).copy()


class ContextCache:
    """The drafter's injected context per request slot: per layer (k, v) [slots, capacity, H, hd].

    `slot_of[seq_id]` is the request's slot and `length[seq_id]` how many of its context rows are valid (host
    ints: observe extends it, rollback lowers it, nothing is moved)."""

    def __init__(self, drafter: DSparkDrafter, slots: int = 1, capacity: int = 256):
        self.drafter = drafter
        cfg, weight = drafter.config, drafter.fc.weight
        self.shape = (cfg.num_attention_heads, cfg.head_dim)
        self.device, self.dtype = weight.device, weight.dtype
        self.slot_of: dict[int, int] = {}
        self.length: dict[int, int] = {}
        self.generation = 0  # bumped whenever the tensors are reallocated
        self.kv = self._alloc(slots, capacity)
        self._free = list(range(slots - 1, -1, -1))

    def _alloc(self, slots: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (slots, capacity, *self.shape)
        new = lambda: torch.zeros(shape, device=self.device, dtype=self.dtype)  # noqa: E731
        return [(new(), new()) for _ in self.drafter.layers]

    @property
    def slots(self) -> int:
        return self.kv[0][0].shape[0]

    @property
    def capacity(self) -> int:
        return self.kv[0][0].shape[1]

    def slot(self, seq_id: int) -> int:
        """`seq_id`'s slot, assigning a free one (doubling the slots when none is free)."""
        if seq_id not in self.slot_of:
            if not self._free:
                old = self.slots
                self._grow(2 * old, self.capacity)
                self._free = list(range(2 * old - 1, old - 1, -1))
            self.slot_of[seq_id] = self._free.pop()
            self.length[seq_id] = 0
        return self.slot_of[seq_id]

    def reserve(self, length: int) -> None:
        """Room for `length` context rows per slot (capacity doubles until it fits)."""
        if length > self.capacity:
            capacity = self.capacity
            while capacity < length:
                capacity *= 2
            self._grow(self.slots, capacity)

    def _grow(self, slots: int, capacity: int) -> None:
        new = self._alloc(slots, capacity)
        s, c = self.slots, self.capacity
        for (k, v), (nk, nv) in zip(self.kv, new):
            nk[:s, :c].copy_(k)
            nv[:s, :c].copy_(v)
        self.kv = new
        self.generation += 1

    def release(self, seq_id: int) -> None:
        if seq_id in self.slot_of:
            self._free.append(self.slot_of.pop(seq_id))
            self.length.pop(seq_id)

    @torch.no_grad()
    def write(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Context rows of T tokens: slots, positions [T] int64 (device), features [T, m*d] captured target
        layers -> every layer's k, v written at [slot, position] (host lengths are the caller's)."""
        self.drafter.write_context(features.to(self.dtype), slots, positions, self.kv)

    def context(self, slots: torch.Tensor, lengths: torch.Tensor) -> SlotContext:
        """slots, lengths [N] int64 (device) -> the drafter's view of those requests' rows (nothing is copied:
        the attention reads the rows in place)."""
        return SlotContext(self.kv, slots, lengths)


def greedy_draft_tokens(drafter: DSparkDrafter, cache: ContextCache, inputs: torch.Tensor, num_tokens: int) -> Draft:
    """The greedy draft forward, with no host reads (capturable): inputs [3, N] int64 (anchor ids, anchor
    positions = context lengths, slots) -> the `Draft` (tokens [N, num_tokens], confidences or None, no probs)."""
    anchors, positions, slots = inputs
    n = anchors.shape[0]
    context = cache.context(slots, positions)
    return drafter.draft(anchors, positions, context, num_tokens, [0.0] * n, [None] * n, with_probs=False)


def greedy_draft(drafter: DSparkDrafter, cache: ContextCache, inputs: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`greedy_draft_tokens` packed for one copy to the host: packed [N, 2 * num_tokens] float64, the draft tokens
    (exact as float64), then their confidences (0 without a confidence head)."""
    draft = greedy_draft_tokens(drafter, cache, inputs, num_tokens)
    conf = draft.confidence if draft.confidence is not None else torch.zeros_like(draft.tokens, dtype=torch.float)
    return torch.cat([draft.tokens.double(), conf.double()], dim=1)


def advance_greedy(inputs: torch.Tensor, argmax: torch.Tensor, drafts: torch.Tensor) -> None:
    """Greedy acceptance on the device, with no host reads (capturable): request i keeps its first a_i drafts
    (those equal to the target's argmax at their rows), so its next anchor is argmax[i, a_i] at position
    p_i + a_i + 1. inputs [3, N] int64 (anchor ids, positions, slots) are rewritten in place from argmax
    [N, k + 1] and drafts [N, k] int64."""
    accepted = (argmax[:, :-1] == drafts).cumprod(dim=1).sum(dim=1)
    inputs[0].copy_(argmax.gather(1, accepted[:, None])[:, 0])
    inputs[1].add_(accepted + 1)


def advance_and_draft(
    drafter: DSparkDrafter,
    cache: ContextCache,
    inputs: torch.Tensor,
    num_tokens: int,
    argmax: torch.Tensor,
    drafts: torch.Tensor,
    features: torch.Tensor | None = None,
) -> torch.Tensor:
    """The next greedy round from the device's acceptance, with no host reads (capturable): with features
    [n * (k + 1), m*d] (a verify step's, request i's k + 1 tokens from its anchor on) their context rows are
    written first, at the slots and positions the first n inputs hold; then `advance_greedy` of those n inputs
    from argmax [n, k + 1] and drafts [n, k]; then `greedy_draft` of all of inputs [3, B] (B >= n: a graph's
    bucket) -> packed [B, 2 * num_tokens]."""
    n, group = argmax.shape
    live = inputs[:, :n]
    if features is not None:  # token t of request i sits at its anchor's position + t, in its slot
        slots = live[2].repeat_interleave(group, output_size=n * group)
        positions = (live[1][:, None] + torch.arange(group, device=live.device)).reshape(-1)
        cache.write(slots, positions, features)
    advance_greedy(live, argmax, drafts)
    return greedy_draft(drafter, cache, inputs, num_tokens)


class DraftGraphs:
    """CUDA graphs of `greedy_draft` per (bucket, num_tokens) and of `ContextCache.write` per token count,
    captured on first use and dropped when the cache reallocates. A batch of n requests replays the smallest
    bucket >= n; its padding rows draft from slot 0 with an empty context (they only read, and their outputs are
    never looked at). A write graph reads its features at the address it was captured with, so it is keyed by
    that address: the engine always passes the same static buffer."""

    MAX_WRITE_TOKENS = 64  # larger steps (prefill chunks) write eagerly
    MAX_WRITE_GRAPHS = 32  # features at other addresses (not the engine's buffer) stop being captured
    MAX_ADVANCE_GRAPHS = 32  # likewise for the acceptance's inputs of `advance`

    def __init__(self, drafter: DSparkDrafter, cache: ContextCache, buckets: tuple[int, ...]):
        if cache.device.type != "cuda":
            raise ValueError(f"draft graphs need a CUDA drafter, it is on {cache.device}")
        self.drafter, self.cache, self.buckets = drafter, cache, tuple(sorted(buckets))
        self.inputs = PinnedUpload(3, self.buckets[-1], cache.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.writes: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.advances: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: str | None = None  # why a capture failed: everything runs eagerly from then on
        self._where = PinnedUpload(2, self.MAX_WRITE_TOKENS, cache.device)
        self._generation = cache.generation

    def _check_generation(self) -> None:
        if self._generation != self.cache.generation:  # the cache's tensors moved: every graph reads old ones
            self.graphs.clear()
            self.writes.clear()
            self.advances.clear()
            self._generation = self.cache.generation

    @torch.no_grad()
    def write(self, where: torch.Tensor, features: torch.Tensor) -> bool:
        """Replay `ContextCache.write` of T tokens: where [2, T] int64 on the host (slots, positions; numpy or a
        tensor), features
        [T, m*d] on the device. False (nothing written) when T or the graphs' count is over the limit."""
        t = where.shape[1]
        key = (tuple(features.shape), features.data_ptr(), features.stride(), features.dtype)
        if self.failed or not 0 < t <= self.MAX_WRITE_TOKENS or features.device != self.cache.device:
            return False
        self._check_generation()
        if key not in self.writes and len(self.writes) >= self.MAX_WRITE_GRAPHS:
            return False
        static = self._where.put(where)
        if key not in self.writes:
            recorded = self._record(lambda: self.cache.write(static[0], static[1], features))
            if recorded is None:
                return False  # the caller writes eagerly (again, if the warm-up wrote: the write is idempotent)
            self.writes[key] = recorded[0]
        self.writes[key].replay()
        return True

    def _record(self, fn):
        """(a CUDA graph of `fn`, the capture's output) after one warm-up call on a side stream, whose effect is
        then done once already (both callers are idempotent: the write and the draft forward). None, and every
        later call eager, when the capture fails (a host sync inside, say)."""
        device = self.cache.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(device).wait_stream(side)
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn()
        except RuntimeError as err:
            torch.cuda.current_stream(device).wait_stream(side)
            self.failed = str(err)
            logger.warning("no CUDA graph for DSpark drafting, it runs eagerly: %s", err)
            return None
        return graph, out

    def bucket(self, n: int) -> int | None:
        i = bisect.bisect_left(self.buckets, n)
        return None if i == len(self.buckets) else self.buckets[i]

    @torch.no_grad()
    def run(self, inputs: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
        """inputs [3, n] int64 on the host (numpy or a tensor) -> packed [n, 2 * num_tokens] on the device (see
        `greedy_draft`), or None when n exceeds the largest bucket or capturing failed (the caller drafts eagerly)."""
        n = inputs.shape[1]
        bucket = self.bucket(n)
        if bucket is None or self.failed:
            return None
        self._check_generation()
        static = self.inputs.put(inputs, bucket)
        record = lambda: self._record(lambda: greedy_draft(self.drafter, self.cache, static, num_tokens))  # noqa: E731
        return self._replay(self.graphs, (bucket, num_tokens), record, n)

    @staticmethod
    def _replay(store: dict, key, record, n: int) -> torch.Tensor | None:
        """Replay the graph `store[key]`, captured by `record()` (a `_record` result) on first use: the first n rows
        of its output, or None when the capture failed."""
        if key not in store:
            recorded = record()
            if recorded is None:
                return None
            store[key] = recorded
        graph, out = store[key]
        graph.replay()
        return out[:n]

    @torch.no_grad()
    def replay(self, n: int, num_tokens: int) -> torch.Tensor | None:
        """Draft again from the static inputs as they stand on the device (`run` staged n requests, and device
        work may have rewritten them since): packed [n, 2 * num_tokens], or None when that graph is gone."""
        bucket = self.bucket(n)
        self._check_generation()
        recorded = self.graphs.get((bucket, num_tokens))
        if recorded is None or self.failed:
            return None
        graph, out = recorded
        graph.replay()
        return out[:n]

    @torch.no_grad()
    def advance(
        self, n: int, num_tokens: int, argmax: torch.Tensor, drafts: torch.Tensor, features: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """`advance_greedy` of the first n static inputs (as `run` staged them, or the last advance left them)
        from argmax [n, k + 1] and drafts [n, k], then the greedy draft of their bucket, in ONE replay: packed
        [n, 2 * num_tokens]. With features [n * (k + 1), m*d] (the verify step's, each request's k + 1 tokens
        from its anchor on) their context rows are written first, at the slots and positions the inputs hold.
        The graph reads argmax, drafts and features where it was captured, so it is keyed by their addresses (the
        engine and `DSparkProposer` keep them in static buffers). None, with nothing done, when n exceeds the
        largest bucket, capturing failed or too many addresses came (the caller goes on eagerly)."""
        bucket = self.bucket(n)
        if bucket is None or self.failed:
            return None
        self._check_generation()
        address = lambda t: None if t is None else (t.data_ptr(), tuple(t.shape))  # noqa: E731
        key = (n, num_tokens, address(argmax), address(drafts), address(features))
        if key not in self.advances and len(self.advances) >= self.MAX_ADVANCE_GRAPHS:
            return None

        def record():
            static = self.inputs.dev[:, :bucket]
            live = static[:, :n]
            before = live.clone()
            step = (self.drafter, self.cache, static, num_tokens, argmax, drafts, features)
            recorded = self._record(lambda: advance_and_draft(*step))
            live.copy_(before)  # undo the warm-up's advance: the replay advances once
            return recorded

        return self._replay(self.advances, key, record, n)
