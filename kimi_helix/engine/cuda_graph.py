"""CUDA graphs of the engine's decode and verify steps.

A decode step at batch 1 launches hundreds of small kernels; eagerly each costs 9-15 us of host time, far more
than its GPU time. `StepGraphs` captures `ModelRunner.forward` once per (phase, bucket, tokens per sequence) and
replays it: one launch for the whole step.

- Uniform steps only: every sequence DECODE (1 token), or every sequence VERIFY with the same 1 + k tokens
  (k <= `max_draft_tokens`), or one request's whole fresh prompt wanting only its last row's logits (a prefill,
  up to the largest prefill bucket). Mixed steps, batched or chunked prefills and longer prompts run eagerly.
- Prefill buckets: a prompt of T tokens replays the graph of the smallest bucket >= T, its rows past T padding
  (`runner.PrefillPadding`, staged as a second sequence on the scratch page and slot). The layers see one
  sequence of all the rows: attention is causal, so the live rows never see the padding, and the KDA layers keep
  it out of the live sequence's states (`modeling.batch.TailPadding`). The host-built launch layouts of the
  prefill kernels (`kernels.layouts`) are held by the graph that reads them.
- Batch buckets: a step of n sequences replays the graph of the smallest bucket >= n; graphs are captured on
  first use (one memory pool is shared and replays never overlap).
- Static inputs: the graph reads the runner's staging buffer (`runner.StepBuffers`: ids, positions, cu_seqlens,
  block table, cache lengths, token slots, state slots) at the offsets of its shape. `ModelRunner.prepare` writes
  the live rows and the padding rows (`runner.Padding`: they address only a scratch sequence the graphs own, one
  cache page and one state slot) on the host and uploads them in one copy before each replay.
- Verify steps and KDA rollback: the KDA layers write a verify step's per-token states and conv inputs into the
  cache's static verify scratch (`PagedCache.reserve_verify_scratch`, sized for the largest graphed verify step:
  the largest bucket whose batch x (1 + max_draft_tokens) tokens fit `verify_tokens`, which the engine takes from
  the planner, `planner.verify_graph_tokens`, so that the memory is priced before the cache is sized), and after
  each replay the records that `PagedCache.rollback` reads are rebuilt for the step's own sequences from what the
  capture recorded. An engine without verify steps passes max_draft_tokens = 0: no verify graph, no scratch.
- Every launch decision inside the step comes from shapes fixed at capture (the bucket, the block-table width,
  the cache's dtype and page size), never from the step's lengths, which the kernels read on the device; so a
  graph captured once is valid for any lengths up to the block table's capacity. Nothing in the step reads a
  device value on the host; the logits stay in the graph's output buffer until the next replay.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..kernels.layouts import retained
from ..modeling.batch import ForwardBatch, Phase, TailPadding
from .cache import CacheView
from .planner import verify_graph_tokens
from .runner import ModelRunner, Padding, PrefillPadding, RunnerOutput, StepInputs
from .scheduler import ScheduledStep

logger = logging.getLogger(__name__)

__all__ = ["SCRATCH_SEQ_ID", "GraphKey", "StepGraphs", "default_buckets", "default_prefill_buckets"]

# The ledger entry of the graphs' scratch sequence (request ids are >= 0; profiling steps use small negative ids).
SCRATCH_SEQ_ID = -(1 << 62)


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes with a graph: powers of two up to 8, then steps of 8 to 64, of 32 to 256, of 64 beyond (as
    vLLM/SGLang bucket them: padding waste stays under ~12% above 64)."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, 257, 32), *range(320, 1025, 64)]
    capped = [s for s in sizes if s < max_num_seqs]
    return (*capped, max_num_seqs)


def default_prefill_buckets(max_num_tokens: int) -> tuple[int, ...]:
    """Padded lengths of the graphed prefills: powers of two from 16 to 512 tokens, within the step's budget.
    Longer prompts run eagerly, where the launches cost little next to the work."""
    return tuple(s for s in (16, 32, 64, 128, 256, 512) if s <= max_num_tokens)


class GraphKey(NamedTuple):
    """One captured step shape: its phase, the bucket (sequences) and the new tokens per sequence (a prefill: one
    sequence, padded to that many rows)."""

    phase: Phase
    batch: int
    tokens_per_seq: int


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly from the static buffers (`use_graphs=False`)
    logits: torch.Tensor  # [batch * tokens_per_seq, V] fp32, the graph's output buffer
    view: CacheView | None = None  # the view captured with: what its KDA layers recorded for verify rollback
    layouts: list | None = None  # the host-built launch layouts the graph reads (`kernels.layouts`), kept alive


class StepGraphs:
    """Captured decode and verify steps of one `ModelRunner`.

    Args:
        runner: the runner whose `forward` and buffers are captured (CUDA only).
        buckets: batch sizes to capture (default `default_buckets`), capped by the runner's buffers.
        max_draft_tokens: the largest k of a verify step taken by a graph.
        use_graphs: False runs each padded bucket-shaped step eagerly from the same static buffers instead of
            replaying a graph (any device): a graph's exact inputs without capture, to tell a capture problem from
            a padding problem, and what the CPU tests check the padding with.
        verify_tokens: tokens of KDA verify scratch; verify steps of buckets whose batch x (1 + max_draft_tokens)
            tokens do not fit run eagerly. None: `planner.verify_graph_tokens` of the runner's sizes (the engine
            passes the count its memory plan priced).
        prefill_buckets: padded lengths of the graphed prefills (None: `default_prefill_buckets`; () graphs
            none). A step that is one request's whole fresh prompt, wanting only its last row's logits, replays the
            smallest that holds it.

    Reserves a scratch sequence in the runner's ledger (one state slot, one page): the engine sizes its ledger
    one slot and one page above what requests may use. The verify scratch is allocated at the first verify step.
    """

    def __init__(
        self,
        runner: ModelRunner,
        buckets: tuple[int, ...] | None = None,
        max_draft_tokens: int = 8,
        use_graphs: bool = True,
        verify_tokens: int | None = None,
        prefill_buckets: tuple[int, ...] | None = None,
    ):
        if use_graphs and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        if not isinstance(max_draft_tokens, int) or max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be an int >= 0, got {max_draft_tokens!r}")
        b = runner.buffers
        self.max_seqs, self.max_tokens = runner.max_num_seqs, b.max_tokens
        ledger = runner.cache.ledger
        if max_draft_tokens + 1 > ledger.page_size:
            raise ValueError(f"max_draft_tokens + 1 = {max_draft_tokens + 1} must fit one page ({ledger.page_size})")
        self.runner = runner
        self.max_draft_tokens = max_draft_tokens
        self.buckets = tuple(sorted(s for s in (buckets or default_buckets(self.max_seqs)) if s <= self.max_seqs))
        if not self.buckets:
            raise ValueError(f"no bucket fits the runner's {self.max_seqs} sequences")
        if verify_tokens is None:
            verify_tokens = verify_graph_tokens(self.max_seqs, self.max_tokens, max_draft_tokens)
        fits = [s for s in self.buckets if s * (max_draft_tokens + 1) <= verify_tokens]
        self.max_verify_seqs = max(fits, default=0) if max_draft_tokens else 0  # the largest verify-graph bucket
        if prefill_buckets is None:
            prefill_buckets = default_prefill_buckets(self.max_tokens)
        bad = [s for s in prefill_buckets if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"prefill_buckets must be ints >= 1 (token counts), got {bad!r} in {prefill_buckets!r}")
        self.prefill_buckets = tuple(sorted(s for s in prefill_buckets if s <= self.max_tokens))
        self._spans: dict[int, torch.Tensor] = {}  # [0, rows] int32 on the device: a padded prefill's cu_seqlens
        scratch = ledger.admit(SCRATCH_SEQ_ID, max_draft_tokens + 1, map_now=True)
        self.scratch_page, self.scratch_slot = scratch.pages[0], scratch.slot
        runner.cache.reset_state(scratch.slot)
        # every logit row of a uniform step, in packed order (ModelRunner.logit_tokens for decode and verify)
        self.rows = torch.arange(self.max_tokens, device=runner.device)
        self.use_graphs = use_graphs
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.graphs: dict[GraphKey, _Captured] = {}
        self.uncapturable: dict[GraphKey, str] = {}  # shapes whose forward syncs with the host, and why
        self._captured_hooks: tuple[int, ...] = ()  # the graph-safe hooks every graph in `graphs` recorded

    # ---------------------------------------------------------------- dispatch
    def key_for(self, step: ScheduledStep) -> GraphKey | None:
        """The graph shape that serves `step`, or None when it must run eagerly (mixed phases, a prefill that is
        not one whole fresh prompt within the prefill buckets, verify groups of unequal or too many drafts, more
        sequences or tokens than the largest bucket, a verify step beyond the verify scratch)."""
        phase = step.phases[0] if step.phases else Phase.PREFILL
        if any(p is not phase for p in step.phases):
            return None
        if phase is Phase.PREFILL:
            return self._prefill_key(step)
        q = len(step.token_ids[0])
        if any(len(t) != q for t in step.token_ids) or q > self.max_draft_tokens + 1:
            return None
        i = bisect.bisect_left(self.buckets, len(step.requests))
        if i == len(self.buckets) or self.buckets[i] * q > self.max_tokens:
            return None
        if phase is Phase.VERIFY and self.buckets[i] > self.max_verify_seqs:
            return None
        return GraphKey(phase, self.buckets[i], q)

    def _prefill_key(self, step: ScheduledStep) -> GraphKey | None:
        """A prefill's graph: one request's whole prompt from its start, logits of its last row only, in the
        smallest prefill bucket that holds it."""
        if len(step.requests) != 1:
            return None
        request, n = step.requests[0], step.num_tokens[0]
        if request.num_computed or self.runner.logit_tokens(request, Phase.PREFILL, 0, n) != range(n - 1, n):
            return None
        i = bisect.bisect_left(self.prefill_buckets, n)
        return None if i == len(self.prefill_buckets) else GraphKey(Phase.PREFILL, 1, self.prefill_buckets[i])

    def run(self, step: ScheduledStep) -> RunnerOutput | None:
        """Replay the graph for `step` (capturing it on first use); None when the step has no graph shape or its
        forward cannot be captured (see `capture`)."""
        key = self.key_for(step)
        hooks = self._graph_safe_hooks() if key is not None and key not in self.uncapturable else None
        if hooks is None:
            return None
        if hooks != self._captured_hooks:  # graphs recorded without (or with other) copy hooks would skip them
            self.graphs.clear()
            self._captured_hooks = hooks
        captured = self.graphs.get(key) or self.capture(key)
        if captured is None:
            return None
        inputs, rows = self.runner.prepare(step, self._padding(key))
        if captured.graph is None:
            full = self._inputs(key)
            with torch.no_grad():
                captured.logits = self.runner.forward(full)
            captured.view = full.view
        else:
            captured.graph.replay()
        inputs.view.commit(inputs.batch, recorded=captured.view)
        return RunnerOutput(captured.logits[: step.total_tokens], rows)

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Run the captured step `key` again on the static buffers as they stand on the device (staged there by the
        work before it, `speculative.async_rounds`): its logits [batch * tokens_per_seq, V]. Prepares and commits
        nothing."""
        captured = self.graphs[key]
        if captured.graph is None:
            with torch.no_grad():
                captured.logits = self.runner.forward(self._inputs(key))
        else:
            captured.graph.replay()
        return captured.logits

    def _padding(self, key: GraphKey) -> Padding | PrefillPadding:
        """The rows that fill `key`'s bucket: sequences (a prefill's rows) on the scratch page and state slot."""
        if key.phase is Phase.PREFILL:
            return PrefillPadding(key.tokens_per_seq, self.scratch_page, self.scratch_slot)
        return Padding(key.batch, key.tokens_per_seq, self.scratch_page, self.scratch_slot)

    def _graph_safe_hooks(self) -> tuple[int, ...] | None:
        """Identities of the forward hooks on the model and its layers when all are graph-safe (a graph replays the
        ones attached when it was captured), else None: such a hook must see every step and a replay runs no
        Python, so steps run eagerly while one is attached. Hooks marked `graph_safe` (DSpark's static-buffer
        feature capture) only copy into a static buffer, which the graph records and replays."""
        model = self.runner.model.model
        ids = []
        for hook in (
            *model._forward_hooks.values(),
            *(h for layer in model.layers for h in layer._forward_hooks.values()),
        ):
            if not getattr(hook, "graph_safe", False):
                return None
            ids.append(id(hook))
        return tuple(ids)

    # ---------------------------------------------------------------- capture
    def capture(self, key: GraphKey) -> _Captured | None:
        """Warm up (compiles every Triton kernel at these shapes) and capture one step shape; every row is a
        padding row meanwhile, so capture writes only the scratch sequence.

        The first warm-up pass runs with synchronising CUDA calls made errors: a step that reads device values on
        the host (a torch reference kernel chosen by the backend switch, say) cannot be replayed, so its shape is
        recorded in `uncapturable` (with the reason) and runs eagerly. Returns None then."""
        if key.phase is Phase.VERIFY:
            self.runner.cache.reserve_verify_scratch(self.max_verify_seqs * (self.max_draft_tokens + 1))
        captured = _Captured(graph=torch.cuda.CUDAGraph() if self.use_graphs else None, logits=torch.empty(0))
        if captured.graph is None:
            self.graphs[key] = captured
            return captured
        device = self.runner.device
        self.runner.prepare(ScheduledStep([], [], []), self._padding(key))
        inputs = self._inputs(key)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.no_grad(), torch.cuda.stream(side):
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    self.runner.forward(inputs)
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
                self.runner.forward(inputs)
            torch.cuda.current_stream(device).wait_stream(side)
            with torch.no_grad(), retained() as captured.layouts, torch.cuda.graph(captured.graph, pool=self.pool):
                captured.logits = self.runner.forward(inputs)
        except RuntimeError as err:
            torch.cuda.current_stream(device).wait_stream(side)
            self.uncapturable[key] = str(err)
            logger.warning("no CUDA graph for %s, it runs eagerly: %s", key, err)
            return None
        captured.view = inputs.view
        self.graphs[key] = captured
        return captured

    def _inputs(self, key: GraphKey) -> StepInputs:
        """The runner's buffers as a step of `key`'s full shape: what the captured forward reads."""
        if key.phase is Phase.PREFILL:
            return self._prefill_inputs(key.tokens_per_seq)
        n, t = key.batch, key.batch * key.tokens_per_seq
        dev = self.runner.buffers.fields(t, n, t)
        batch = ForwardBatch(
            seq_lens=[key.tokens_per_seq] * n,
            context_lens=[0] * n,
            cu_seqlens=dev.cu_seqlens,
            positions=dev.positions,
            phases=[key.phase] * n,
        )
        view = CacheView(
            self.runner.cache,
            [SCRATCH_SEQ_ID] * n,
            dev.block_table,
            dev.state_indices,
            cache_seqlens=dev.cache_seqlens,
            slot_mapping=dev.slot_mapping,
            backend=self.runner.attention_backend,
        )
        return StepInputs(dev.input_ids, batch, view, self.rows[:t])

    def _prefill_inputs(self, rows: int) -> StepInputs:
        """A padded prefill of `rows` rows as the layers see it: one sequence of all the rows, whose padding the
        KDA layers keep out of the live sequence's states (`TailPadding`: the staged two-sequence layout)."""
        dev = self.runner.buffers.fields(rows, 2, 1)
        span = self._spans.get(rows)
        if span is None:
            span = self._spans[rows] = torch.tensor([0, rows], dtype=torch.int32, device=self.runner.device)
        batch = ForwardBatch(
            seq_lens=[rows],
            context_lens=[0],
            cu_seqlens=span,
            positions=dev.positions,
            phases=[Phase.PREFILL],
            tail_padding=TailPadding(dev.cu_seqlens, dev.state_indices),
        )
        view = CacheView(
            self.runner.cache,
            [SCRATCH_SEQ_ID],
            dev.block_table[:1],
            dev.state_indices[:1],
            cache_seqlens=dev.cache_seqlens[:1],
            slot_mapping=dev.slot_mapping,
            backend=self.runner.attention_backend,
        )
        return StepInputs(dev.input_ids, batch, view, dev.logits_index)
