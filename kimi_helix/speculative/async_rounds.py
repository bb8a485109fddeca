"""Asynchronous DSpark rounds: round N + 1 is staged on the device and launched before round N's verdict reaches
the host.

A synchronous round waits for the verify step's argmax rows, accepts on the host, rolls the KDA state back, stages
the next verify step on the host and uploads it: the GPU idles through all of it, and at batch 1 that host work
takes longer than the round's GPU work. Here every greedy DSpark round after the first is derived on the device
from the one before (`round_tail`, one CUDA graph a batch shape):

- the argmax of the verify step's rows, the device's acceptance, and the next verify step's token ids (the next
  anchors), positions, token slots and cache lengths written into the runner's static step buffer, with the
  drafter's inputs advanced (`kernels.accept_stage`, one launch);
- the KDA rollback to "after the anchor and the accepted drafts", indexed by the accepted count on the device
  (`PagedCache.restore_verified`, one launch);
- the drafter's context write of the verified tokens and the next draft (`drafting.greedy_draft`), whose tokens
  fill the next step's draft rows;
- the round's argmax rows and accepted counts, copied to the host through pinned memory.

The host replays the verify graph and the tail, then reads the round before (its tokens, EOS and stop checks,
lengths): one round behind, so the GPU always has the next round queued. What the host cannot know ahead it
provides ahead: every request maps its cache pages and drafter rows for two rounds of 1 + k tokens, up to its
reservation; tokens past it (the last rounds' drafts beyond `max_tokens`) are written to the graphs' scratch page,
which the block table holds past every sequence's pages. A request that stops in round N was already in round N + 1:
that round's tokens for it are dropped (its state slot is zeroed and its pages freed after it, in stream order), and
a round's drafts past `max_tokens` count in the metrics as the synchronous round's shorter draft would.

Rounds overlap only while the batch is steady: every running request greedy DSpark, past its prompt, with more than
one token left by `max_tokens` (1 + k to enter), no request waiting, no logprobs, fixed k, one process, a graph shape
for the verify step, and block-table room for three rounds past its last token. Anything else first completes the
round in flight (`drain`), which leaves the engine exactly as a synchronous round would have, and runs
synchronously.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..engine.runner import PAD_TOKEN_ID
from ..engine.scheduler import ScheduledStep
from ..kernels.accept_stage import accept_and_stage
from ..modeling.batch import Phase
from .dspark.drafting import PinnedUpload, greedy_draft, greedy_draft_tokens
from .proposers import DSparkProposer

logger = logging.getLogger(__name__)

__all__ = ["AsyncRounds"]


class _Round:
    """A launched round: its requests, their anchor positions (None while the round before is unread), and the
    host copy of its argmax rows and accepted counts (`read` waits for it)."""

    def __init__(self, requests, positions, read):
        self.requests = requests
        self.positions: list[int] | None = positions
        self.read = read


class AsyncRounds:
    """Overlapped greedy DSpark rounds of one `LLM` (see the module docstring): `step` launches the next round and
    completes the one before; `drain` completes the round in flight."""

    def __init__(self, llm):
        self.llm = llm
        self.decoder = llm.speculative
        self.k = self.decoder.num_tokens
        self.group = self.k + 1
        self.device = llm.device
        self.in_flight: _Round | None = None
        self.disabled: str | None = None  # why rounds run synchronously from now on (no graph for a shape, say)
        self.entered = self.launched = 0  # steady batches entered, and rounds launched from the device's staging
        seqs = llm.scheduler.max_num_seqs
        self._draft_inputs = PinnedUpload(3, seqs, self.device)  # anchors, positions, slots: advanced in place
        self._pages = PinnedUpload(2, 16, self.device)  # (flat block-table index, page id) of newly mapped pages
        self._argmax = torch.zeros(seqs * self.group, dtype=torch.int64, device=self.device)
        self._result = torch.zeros(seqs, self.group + 1, dtype=torch.int64, device=self.device)
        self._write_at = torch.zeros(2, seqs * self.group, dtype=torch.int64, device=self.device)  # context rows
        pinned = self.device.type == "cuda"
        self._host = [torch.zeros(seqs, self.group + 1, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self._key = None  # the verify graph's key of the steady batch
        self._fields = None  # the runner's static step buffer at that key's shape
        self._step: ScheduledStep | None = None
        self._tails: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self._use_graphs() else None

    def _use_graphs(self) -> bool:
        graphs = self.llm.runner.graphs
        return graphs is not None and graphs.use_graphs

    # ---------------------------------------------------------------- eligibility
    def can_overlap(self) -> bool:
        """Whether the next round may be launched before the one in flight is read (module docstring)."""
        llm, decoder = self.llm, self.decoder
        proposer = decoder.proposer
        if self.disabled or decoder.step_rate is not None or decoder.comm is not None or llm.runner.graphs is None:
            return False
        if not isinstance(proposer, DSparkProposer) or decoder.capture is None or decoder.capture.buffer is None:
            return False
        scheduler = llm.scheduler
        running = scheduler.running
        if scheduler.waiting or not running or len(running) * self.group > scheduler.max_num_batched_tokens:
            return False
        flight = self.in_flight
        if flight is not None and (len(flight.requests) != len(running) or any(
                a is not b for a, b in zip(flight.requests, running))):  # fmt: skip
            return False
        room = llm.runner.buffers.max_pages * llm.cache.ledger.page_size  # positions a block-table row addresses
        for r in running:
            params = r.params
            if r.prefilling or r.pending != 1 or not params.greedy:
                return False
            if params.logprobs is not None or params.prompt_logprobs is not None:
                return False
            # An entering round is staged on the host, within the reservation: 1 + k tokens must be left. Later
            # rounds run until one token is left (the round in flight, or a plain step, ends the request then).
            if params.max_tokens - len(r.output_ids) < (2 if flight is not None else self.group):
                return False
            if len(r.token_ids) + 3 * self.group > room:
                return False
            if flight is None and proposer.context_len(r.request_id) != len(r.token_ids) - 1:
                return False
        if flight is None:
            key = llm.runner.graphs.key_for(self._verify_step(running))
            if key is None or key.phase is not Phase.VERIFY or key in llm.runner.graphs.uncapturable:
                return False
        return True

    def _verify_step(self, requests) -> ScheduledStep:
        """The scheduler's view of a round: every request a verify group of its anchor and k placeholders."""
        ids = [[r.output_ids[-1], *([PAD_TOKEN_ID] * self.k)] for r in requests]
        return ScheduledStep(list(requests), [Phase.VERIFY] * len(requests), ids)

    # ---------------------------------------------------------------- rounds
    def step(self) -> int | None:
        """Launch a round, then complete the one before it. Returns how many requests finished, or None when the
        first round of a steady batch could not be launched (the caller runs a synchronous step)."""
        start = time.perf_counter()
        previous = self.in_flight
        if previous is None:
            self.in_flight = self._enter()
            if self.in_flight is None:
                return None
        else:
            self.in_flight = self._launch(previous)
        finished, generated, rounds = self._complete(previous) if previous is not None else (0, 0, 0)
        self.llm._record_step(start, self._step, generated, rounds)
        return finished

    def drain(self) -> int:
        """Complete the round in flight, if any, and hand the engine back in a synchronous round's state: pages
        past each request's length freed, no verify records, the proposer drafting from the host again. Returns
        how many requests finished."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return 0
        finished, _, _ = self._complete(flight, last=True)
        ledger = self.llm.cache.ledger
        for r in flight.requests:
            if r.finish_reason is None:
                ledger.truncate(r.request_id, r.num_computed)
        self.llm.cache.verify_records = {}
        self.decoder.proposer.end_device_rounds()
        return finished

    def discard(self) -> None:
        """Forget the round in flight (its requests are being aborted); the device finishes it in stream order."""
        if self.in_flight is not None:
            self.in_flight = None
            self.decoder.proposer.end_device_rounds()

    def _enter(self) -> _Round | None:
        """The first round of a steady batch, staged on the host: draft, run the verify step through the runner's
        graphs with the drafts patched in, then the tail."""
        llm, proposer = self.llm, self.decoder.proposer
        requests = list(llm.scheduler.running)
        n, k = len(requests), self.k
        proposer.begin_device_rounds()
        cache = proposer.cache
        slots = [cache.slot(r.request_id) for r in requests]
        positions = [len(r.token_ids) - 1 for r in requests]
        self._fields = None  # the entry's step uploads the block table itself, with these pages
        self._map_ahead(requests, positions, rounds=2)
        inputs = np.array([[r.output_ids[-1] for r in requests], positions, slots], dtype=np.int64)
        draft_inputs = self._draft_inputs.put(inputs)
        packed = proposer.graphs.run(inputs, k) if proposer.graphs is not None else None
        if packed is None:
            packed = greedy_draft(proposer.drafter, cache, draft_inputs, k)
        step = self._verify_step(requests)
        runner = llm.runner
        patch, runner.input_patch = runner.input_patch, lambda s, ids: ids.view(n, -1)[:, 1:].copy_(packed[:, :k])
        try:
            out = runner.graphs.run(step)
        finally:
            runner.input_patch = patch
        if out is None:
            self.disabled = "the verify step has no graph shape or could not be captured"
            proposer.end_device_rounds()
            return None
        self._check_scratch_layout(requests)
        self.entered += 1
        key = self._key = runner.graphs.key_for(step)
        self._step, tokens = step, key.batch * key.tokens_per_seq
        self._fields = runner.buffers.fields(tokens, key.batch, tokens)  # what the verify graph reads
        self._tail(out.logits)
        return _Round(requests, positions, self._fetch(n))

    def _check_scratch_layout(self, requests) -> None:
        """`PagedCache.restore_verified` reads group i's records at scratch row i * (1 + k) and conv row i."""
        for records in self.llm.cache.verify_records.values():
            for i, r in enumerate(requests):
                if records[r.request_id].scratch_at != (i * self.group, i):
                    raise RuntimeError(f"verify records of request {r.request_id} are not where rounds read them")

    def _launch(self, previous: _Round) -> _Round:
        """A round staged on the device by the previous round's tail: map pages and drafter rows for it and the
        round after, replay the verify step and the tail, start the copy of the verdict."""
        requests, n = previous.requests, len(previous.requests)
        self.launched += 1
        self._map_ahead(requests, previous.positions, rounds=3)
        logits = self.llm.runner.graphs.replay(self._key)
        self._tail(logits)
        return _Round(requests, None, self._fetch(n))

    def _map_ahead(self, requests, positions: list[int], rounds: int) -> list[tuple[int, int]]:
        """Map each request's pages for `rounds` rounds of 1 + k tokens from its known anchor (capped at its
        reservation) and room for as many drafter rows: the tail launched next stages the round after the one it
        ends, with token slots read from the block table. Returns the (flat block-table index, page id) of every
        page mapped now."""
        ledger, width = self.llm.cache.ledger, self.llm.runner.buffers.max_pages
        mapped = []
        for i, (r, p) in enumerate(zip(requests, positions)):
            blocks = ledger.seqs[r.request_id]
            have = len(blocks.pages)
            ledger.map(r.request_id, min(p + rounds * self.group, blocks.reserve_tokens))
            mapped += [(i * width + j, blocks.pages[j]) for j in range(have, len(blocks.pages))]
        self.decoder.proposer.cache.reserve(max(positions) + rounds * self.group)
        if mapped and self._fields is not None:  # into the verify step's block table, before the tail reads it
            if self._pages.dev.shape[1] < len(mapped):
                self._pages = PinnedUpload(2, 2 * len(mapped), self.device)
            dev = self._pages.put(np.array(mapped, dtype=np.int64).T)
            self._fields.block_table.view(-1).index_copy_(0, dev[0], dev[1].to(torch.int32))
        return mapped

    def _tail(self, logits: torch.Tensor) -> None:
        """`round_tail` of the verify step just launched: replayed from a graph per batch shape (the first call
        of a shape runs it eagerly, then captures it)."""
        key = (self._key, self.decoder.proposer.cache.generation, logits.data_ptr())
        graph = self._tails.get(key)
        if graph is not None:
            graph.replay()
            return
        if self._pool is None:
            self.round_tail(logits)
            return
        device = self.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.round_tail(logits)  # the warm-up is this round's real tail; the capture runs nothing
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self.round_tail(logits)
        except RuntimeError as err:
            logger.warning("no CUDA graph for the speculative round's tail, it runs eagerly: %s", err)
            self._pool = None
            return
        self._tails[key] = graph

    @torch.no_grad()
    def round_tail(self, logits: torch.Tensor) -> None:
        """Everything between two verify steps, on the device: argmax, acceptance and staging of the next verify
        step, KDA rollback, context write and next draft, the verdict for the host (module docstring)."""
        proposer, k, group, fields = self.decoder.proposer, self.k, self.group, self._fields
        n = len(self._step.requests)
        t, backend = n * group, self.llm.backends.kernels
        argmax = torch.argmax(logits[:t], dim=-1, out=self._argmax[:t]).view(n, group)
        result, write_at, draft_inputs = self._result[:n], self._write_at[:, :t], self._draft_inputs.dev[:, :n]
        accept_and_stage(argmax, draft_inputs, fields.input_ids[:t], fields.positions[:t], fields.slot_mapping[:t],
                         fields.cache_seqlens[:n], fields.block_table[:n], result, write_at,
                         self.llm.cache.ledger.page_size, backend=backend)  # fmt: skip
        self.llm.cache.restore_verified(fields.state_indices[:n], result[:, group], group, backend=backend)
        proposer.cache.write(write_at[0], write_at[1], self.decoder.capture.buffer[:t])
        drafts = greedy_draft_tokens(proposer.drafter, proposer.cache, draft_inputs, k).tokens
        fields.input_ids[:t].view(n, group)[:, 1:].copy_(drafts)

    def _fetch(self, n: int):
        """Start copying the round's verdict [n, 2 + k] to the host; returns a callable giving it (numpy)."""
        host = self._host[self._turn][:n]
        self._turn ^= 1
        host.copy_(self._result[:n], non_blocking=True)
        if self.device.type != "cuda":
            return host.numpy
        done = torch.cuda.Event()
        done.record()

        def read() -> np.ndarray:
            done.synchronize()
            return host.numpy()

        return read

    def _complete(self, done: _Round, last: bool = False) -> tuple[int, int, int]:
        """Read `done`'s verdict: append each request's accepted drafts and its next token (they are the argmax
        rows up to the first rejection), finish the requests that stop there, and set the lengths a synchronous
        round's rollback would leave. The anchors of the round launched after it follow. Returns (requests
        finished, tokens appended, verify groups)."""
        verdict = done.read()
        llm, metrics, group = self.llm, self.decoder.metrics, self.group
        ledger, lengths = llm.cache.ledger, self.decoder.proposer.cache.length
        finished = generated = groups = 0
        following = []
        for r, p, row in zip(done.requests, done.positions, verdict):
            accepted = int(row[group])
            keep = p + accepted + 1
            following.append(keep)
            if r.finish_reason is not None:  # stopped in an earlier round: this one ran past its end
                continue
            drafts = min(self.k, r.params.max_tokens - len(r.output_ids) - 1)  # what a synchronous round verifies
            if drafts > 0:
                metrics.add(drafts, min(accepted, drafts))
                groups += 1
            stopped = False
            for token in row[: accepted + 1].tolist():
                generated += 1
                if llm._append(r, token):
                    stopped = True
                    break
            if stopped:
                finished += 1
                continue
            r.num_computed = keep
            ledger.seqs[r.request_id].length = keep
            lengths[r.request_id] = keep
        if not last and self.in_flight is not None:
            self.in_flight.positions = following
        return finished, generated, groups
