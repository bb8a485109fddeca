"""Proposers: what drafts the tokens a verify step checks. All of them follow one protocol (`Proposer`).

Per step the engine hands each speculative request to `propose` as a `ProposalRequest` (its tokens so far, the
last one being the anchor, which the target has not run yet) and gets back a `Proposal` of at most
`num_tokens` drafts with the distributions they were drawn from. Proposers that read target hidden states name
their layers in `target_layer_ids`; the engine then calls `observe` with the captured features of every token the
target runs and `rollback` after verification with the number of tokens kept. `release` frees a finished request.
See docs/speculative.md for writing a custom proposer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..engine.cuda_graph import default_buckets
from ..engine.sampling import GREEDY_TEMPERATURE
from .dspark.drafting import (
    ContextCache,
    DraftGraphs,
    PinnedDownload,
    PinnedUpload,
    advance_and_draft,
    advance_greedy,
    greedy_draft,
)
from .dspark.model import DSparkDrafter


@dataclass
class ProposalRequest:
    """One request to draft for: `token_ids` (prompt + generated, the last is the anchor at position
    `len(token_ids) - 1`), at most `num_tokens` drafts, the request's `temperature` and `generator`."""

    seq_id: int
    token_ids: Sequence[int]
    num_tokens: int
    temperature: float = 0.0
    generator: torch.Generator | None = None


@dataclass
class Proposal:
    """`token_ids`: the drafts (possibly fewer than asked, possibly none); `probs`: [len, V] the distributions
    they were drawn from, or None for a deterministic proposer (a point mass at each draft); `confidence`: per
    draft, its predicted acceptance given its prefix's (None if the proposer has no confidence head)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None


@dataclass
class DeviceDrafts:
    """Greedy drafts left on the device (`Proposer.propose_on_device`): request i's `counts[i]` drafts are
    tokens[i, :counts[i]] ([N, k] int64, device)."""

    tokens: torch.Tensor
    counts: list[int]


@dataclass
class _GreedyRound:
    """A greedy round of `DSparkProposer.propose_on_device`: its requests, drafts k, device inputs [3, N] (the
    graph's static inputs or the eager upload), `redraft`, which drafts again from those inputs as they stand, and
    `advance`, `drafting.advance_and_draft` on those inputs (the verify step's context write, the device's
    acceptance, the next draft): one graph replay for a graphed round (`DraftGraphs.advance`, None when it
    cannot)."""

    seq_ids: tuple[int, ...]
    k: int
    inputs: torch.Tensor
    redraft: Callable[[], torch.Tensor | None]
    advance: Callable[..., torch.Tensor | None]


@dataclass
class _DraftAhead:
    """Drafts launched by `DSparkProposer.draft_ahead`: `packed` as `greedy_draft`'s, from the inputs the device
    derived, which `derived` holds on their way to the host."""

    round: _GreedyRound
    packed: torch.Tensor
    derived: PinnedDownload
    generation: int


class Proposer:
    """The protocol, with no-op defaults for proposers that keep no per-request state."""

    name = "proposer"
    target_layer_ids: list[int] = []

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        """One `Proposal` per request, in order."""
        raise NotImplementedError

    def propose_on_device(self, requests: Sequence[ProposalRequest]) -> DeviceDrafts | None:
        """Optional: greedy drafts for every request without reading them on the host (the engine then writes them
        into the verify step's inputs on the device and reads them once, with the verification). None: not
        offered for these requests (the default), and `propose` serves them."""
        return None

    def draft_ahead(self, seq_ids: Sequence[int], argmax: torch.Tensor, drafts: torch.Tensor) -> bool:
        """Optional: launch the next round's greedy drafts before the host reads this round's verification.
        seq_ids: the requests of this round's `propose_on_device`, in order; argmax [N, k + 1]: the target's
        greedy tokens at each verify group's rows (device); drafts [N, k]: the group's drafts (device). The
        next `propose_on_device` serves them only if its requests, anchors and positions are exactly those the
        device derived here. False (the default): nothing launched."""
        return False

    def observe(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        """Captured target features [n, m*d] of the tokens at positions start..start+n-1 of `seq_id`."""

    def observe_step(
        self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int], features: torch.Tensor
    ) -> None:
        """One step's features of every request at once: features [sum(counts), m*d], request i's `counts[i]`
        rows at positions starts[i].. of seq_ids[i]. By default `observe` per request; override to batch."""
        offset = 0
        for seq_id, start, n in zip(seq_ids, starts, counts):
            self.observe(seq_id, start, features[offset : offset + n])
            offset += n

    def rollback(self, seq_id: int, num_keep: int) -> None:
        """Forget everything `seq_id` saw beyond its first `num_keep` tokens (after a partial acceptance)."""

    def release(self, seq_id: int) -> None:
        """`seq_id` is finished."""


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the last n tokens, trying
    n from `max_n` down to `min_n`. Deterministic (`probs` None)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(f"NgramProposer needs ints 1 <= min_n <= max_n, got ({min_n!r}, {max_n!r})")
        self.min_n, self.max_n = min_n, max_n

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most k tokens continuing the longest suffix n-gram (min_n..max_n) that occurred before."""
        tokens = list(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            for start in range(length - n - 1, -1, -1):  # most recent earlier occurrence first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.token_ids, r.num_tokens)) for r in requests]


class DSparkProposer(Proposer):
    """Drafts with a `DSparkDrafter` bound to the target. Per request it keeps the drafter's injected context
    keys/values of every token before the anchor in a static per-slot cache (`drafting.ContextCache`: fed by
    `observe_step`, cropped by `rollback`, which only lowers a length).

    Args:
        drafter: the bound drafter.
        max_seqs: the most requests one round drafts for (the engine's `max_num_seqs`): the graphs' largest
            bucket. The cache starts with min(max_seqs, 8) slots of 256 rows and doubles either when a request
            needs more (the graphs recapture then).
        use_graphs: replay all-greedy drafting rounds and the context writes of small steps from CUDA graphs
            (`drafting.DraftGraphs`, CUDA only); sampled rounds, prefill chunks, and everything without graphs
            run the same code eagerly.
    """

    name = "dspark"

    def __init__(self, drafter: DSparkDrafter, max_seqs: int = 8, use_graphs: bool = False):
        if not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs must be an int >= 1, got {max_seqs!r}")
        self.drafter = drafter
        self.target_layer_ids = list(drafter.config.target_layer_ids)
        self.block_size = drafter.config.block_size  # read once: a config attribute costs microseconds a round
        self.cache = ContextCache(drafter, min(max_seqs, 8), 256)
        device = self.cache.device
        self.graphs = DraftGraphs(drafter, self.cache, default_buckets(max_seqs)) if use_graphs else None
        self._observed = PinnedUpload(2, 64, device)  # per-token (slot, position) of observe_step, grown as needed
        self._asked = PinnedUpload(3, max_seqs, device)  # per-request (anchor, position, slot) of eager rounds
        self._round: _GreedyRound | None = None  # the last greedy round, which `draft_ahead` continues
        self._ahead: _DraftAhead | None = None
        self._derived = PinnedDownload(device)
        self._drafts = torch.zeros(0, dtype=torch.int64, device=device)  # device drafts: fixed addresses a round
        self._round_inputs: np.ndarray | None = None  # the host copy of `_round`'s inputs [3, N]
        # (features, slots, starts, counts) of a verify step's context write left to `draft_ahead` (`_defers`)
        self._pending: tuple | None = None
        self.drafted_ahead = self.served_ahead = 0  # rounds drafted by `draft_ahead`, and those then served

    def context_len(self, seq_id: int) -> int:
        return self.cache.length.get(seq_id, 0)

    def observe(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        self.observe_step([seq_id], [start], [features.shape[0]], features)

    @torch.no_grad()
    def observe_step(self, seq_ids, starts, counts, features: torch.Tensor) -> None:
        """Every request's features of one step at once: one context projection and one in-place write per
        layer. seq_ids, starts, counts: per request; features [sum(counts), m*d] in that order. The write of a
        greedy round's verify step is left to `draft_ahead`, which writes, advances and drafts at once (one
        replay where graphed; `_defers`); anything else that reads or writes the context first writes it
        (`_flush`)."""
        self._flush()
        for seq_id, start in zip(seq_ids, starts):
            if start != self.context_len(seq_id):
                raise ValueError(
                    f"request {seq_id}: features start at {start} but the draft context holds "
                    f"{self.context_len(seq_id)} tokens"
                )
        if features.shape[0] != sum(counts):
            raise ValueError(f"features hold {features.shape[0]} rows, the counts {counts} sum to {sum(counts)}")
        slots = [self.cache.slot(s) for s in seq_ids]  # may grow the cache (and bump its generation)
        self.cache.reserve(max(s + n for s, n in zip(starts, counts)))
        if self._defers(seq_ids, starts, counts, slots):
            self._pending = (features, slots, starts, counts)
        else:
            self._write(features, slots, starts, counts)
        for seq_id, start, n in zip(seq_ids, starts, counts):
            self.cache.length[seq_id] = start + n

    def _defers(self, seq_ids, starts, counts, slots) -> bool:
        """Whether a step's context write can wait for `draft_ahead`: the step is exactly the greedy
        round's verify groups, in its order, each of all k drafts, at the anchors' positions and slots (so the
        advance graph finds every token's (slot, position) in its static inputs)."""
        last, host = self._round, self._round_inputs
        if last is None or host is None or tuple(seq_ids) != last.seq_ids:
            return False
        if any(n != last.k + 1 for n in counts):
            return False
        return list(starts) == host[1].tolist() and list(slots) == host[2].tolist()

    def _write(self, features: torch.Tensor, slots, starts, counts) -> None:
        """`ContextCache.write` of features [T, m*d], request i's counts[i] rows at positions starts[i].. of slot
        slots[i]: a graph replay where one serves, else eagerly."""
        counts_np = np.asarray(counts, dtype=np.int64)
        before = np.cumsum(counts_np) - counts_np  # the step's tokens before each request's
        where = np.stack(
            [
                np.repeat(np.asarray(slots, dtype=np.int64), counts_np),
                np.arange(features.shape[0]) + np.repeat(np.asarray(starts, dtype=np.int64) - before, counts_np),
            ]
        )
        if self.graphs is None or not self.graphs.write(where, features):
            if self._observed.dev.shape[1] < where.shape[1]:
                cols = max(where.shape[1], 2 * self._observed.dev.shape[1])
                self._observed = PinnedUpload(2, cols, self.cache.device)
            dev = self._observed.put(where)
            self.cache.write(dev[0], dev[1], features)

    def _flush(self) -> None:
        """Write the context rows `observe_step` left to `draft_ahead`, if they are still pending."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._write(*pending)

    def begin_device_rounds(self) -> None:
        """Hand the context cache to device-derived rounds (`speculative.async_rounds`): write what is pending and
        forget the rounds drafted from the host."""
        self._flush()
        self.end_device_rounds()

    def end_device_rounds(self) -> None:
        """The next round drafts from the host's inputs again (the device-derived rounds set the lengths)."""
        self._ahead = self._round = self._round_inputs = None

    def rollback(self, seq_id: int, num_keep: int) -> None:
        if seq_id in self.cache.length:
            self.cache.length[seq_id] = min(self.cache.length[seq_id], num_keep)

    def release(self, seq_id: int) -> None:
        self._flush()  # before the slot can pass to another request
        self.cache.release(seq_id)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        self._flush()
        self._ahead = self._round = None  # a replay here may overwrite drafts launched ahead
        if not requests:
            return []
        inputs, k, greedy = self._inputs(requests)
        packed = self.graphs.run(inputs, k) if greedy and self.graphs is not None else None
        probs = None
        if packed is None:
            dev = self._upload(inputs)
            if greedy:
                packed = greedy_draft(self.drafter, self.cache, dev, k)
            else:
                packed, probs = self._sampled_draft(requests, dev, k)
        rows = packed.tolist()  # the round's one host sync
        has_conf = self.drafter.confidence_head is not None
        out = []
        for i, (r, row) in enumerate(zip(requests, rows)):
            n = min(r.num_tokens, k)
            conf = row[k : k + n] if has_conf else None
            out.append(Proposal([int(t) for t in row[:n]], None if probs is None else probs[i, :n], conf))
        return out

    def propose_on_device(self, requests: Sequence[ProposalRequest]) -> DeviceDrafts | None:
        """All-greedy rounds: the draft forward (graph-replayed where it can be) with its tokens left on the device,
        so the drafter runs while the host stages the verify step."""
        self._flush()
        if not requests:
            return None
        inputs, k, greedy = self._inputs(requests)
        ahead, self._ahead, self._round, self._round_inputs = self._ahead, None, None, None
        if not greedy:
            return None
        seq_ids = tuple(r.seq_id for r in requests)
        if self._serves(ahead, seq_ids, inputs, k):
            packed, self._round = ahead.packed, ahead.round
            self.served_ahead += 1
        else:
            packed, self._round = self._greedy_round(seq_ids, inputs, k)
        self._round_inputs = inputs
        n = len(requests)
        if self._drafts.numel() < n * k:
            self._drafts = torch.zeros(n * k, dtype=torch.int64, device=self.cache.device)
        tokens = self._drafts[: n * k].view(n, k)  # at the address `DraftGraphs.advance` captured them at
        tokens.copy_(packed[:, :k])
        return DeviceDrafts(tokens, [min(r.num_tokens, k) for r in requests])

    def _serves(self, ahead: _DraftAhead | None, seq_ids, inputs: np.ndarray, k: int) -> bool:
        """Whether the drafts launched ahead are this round's: same requests and k, and the anchors, positions
        and slots the device derived equal the host's own `inputs` (so a device/host disagreement only costs
        a redraft)."""
        if ahead is None or ahead.round.seq_ids != seq_ids or ahead.round.k != k:
            return False
        return ahead.generation == self.cache.generation and np.array_equal(ahead.derived.result(), inputs)

    def _greedy_round(self, seq_ids, inputs: np.ndarray, k: int) -> tuple[torch.Tensor, _GreedyRound]:
        """Draft from the host `inputs` [3, N]: (packed [N, 2k], the round, for `draft_ahead`)."""
        n = inputs.shape[1]
        if self.graphs is not None:
            packed = self.graphs.run(inputs, k)
            if packed is not None:
                graphs = self.graphs
                return packed, _GreedyRound(seq_ids, k, graphs.inputs.dev[:, :n], lambda: graphs.replay(n, k),
                                            functools.partial(graphs.advance, n, k))  # fmt: skip
        dev = self._upload(inputs)
        redraft = lambda: greedy_draft(self.drafter, self.cache, dev, k)  # noqa: E731
        advance = functools.partial(advance_and_draft, self.drafter, self.cache, dev, k)
        return redraft(), _GreedyRound(seq_ids, k, dev, redraft, advance)

    @torch.no_grad()
    def draft_ahead(self, seq_ids: Sequence[int], argmax: torch.Tensor, drafts: torch.Tensor) -> bool:
        """Greedy acceptance on the device: request i keeps its first a_i drafts (those equal to the target's
        argmax), so its next anchor is argmax[i, a_i] at position p_i + a_i + 1, and its draft context then
        holds exactly the rows before it (the context write of this step came first). The last round's device
        inputs are rewritten to those and drafted from again, with nothing read on the host: one graph replay
        for a graphed round (`DraftGraphs.advance`), else `advance_greedy` and the draft."""
        last, self._round = self._round, None
        if last is None or tuple(seq_ids) != last.seq_ids or drafts.shape != (len(last.seq_ids), last.k):
            self._flush()
            return False
        pending, self._pending = self._pending, None
        features = None if pending is None else pending[0]
        packed = last.advance(argmax, drafts, features)
        if packed is None:
            if pending is not None:
                self._write(*pending)
            advance_greedy(last.inputs, argmax, drafts)
            self._derived.fetch(last.inputs)  # queued before the draft: `_serves` need not wait for it
            packed = last.redraft()
            if packed is None:
                return False
        else:
            self._derived.fetch(last.inputs)
        self._ahead = _DraftAhead(last, packed, self._derived, self.cache.generation)
        self.drafted_ahead += 1
        return True

    def _inputs(self, requests: Sequence[ProposalRequest]) -> tuple[np.ndarray, int, bool]:
        """(the draft forward's inputs [3, N]: anchors, their positions, slots; the drafts k; all greedy?)"""
        for r in requests:
            if self.context_len(r.seq_id) != len(r.token_ids) - 1:
                raise ValueError(
                    f"request {r.seq_id}: the draft context holds {self.context_len(r.seq_id)} tokens but the anchor "
                    f"sits at position {len(r.token_ids) - 1}; observe() every token the target runs"
                )
        k = min(max(r.num_tokens for r in requests), self.block_size)
        slots = [self.cache.slot(r.seq_id) for r in requests]
        anchors = [r.token_ids[-1] for r in requests]
        inputs = np.array([anchors, [len(r.token_ids) - 1 for r in requests], slots], dtype=np.int64)
        return inputs, k, all(r.temperature < GREEDY_TEMPERATURE for r in requests)

    def _upload(self, inputs: np.ndarray) -> torch.Tensor:
        """An eager round's inputs on the device (the graphs keep their own static copy)."""
        if self._asked.dev.shape[1] < inputs.shape[1]:
            self._asked = PinnedUpload(3, inputs.shape[1], self.cache.device)
        return self._asked.put(inputs)

    @torch.no_grad()
    def _sampled_draft(self, requests, inputs: torch.Tensor, k: int):
        """A round with sampled requests (eager): packed as `greedy_draft`'s, and the draft distributions."""
        anchors, positions, slots = inputs
        temps, gens = [r.temperature for r in requests], [r.generator for r in requests]
        draft = self.drafter.draft(anchors, positions, self.cache.context(slots, positions), k, temps, gens)
        conf = draft.confidence if draft.confidence is not None else torch.zeros_like(draft.tokens, dtype=torch.float)
        return torch.cat([draft.tokens.double(), conf.double()], dim=1), draft.probs
