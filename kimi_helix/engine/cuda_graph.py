"""CUDA graphs of the engine's decode and verify steps.

A decode step at batch 1 launches hundreds of small kernels; eagerly each costs 9-15 us of host time, far more
than its GPU time. `StepGraphs` captures `ModelRunner.forward` once per (phase, bucket, tokens per sequence) and
replays it: one launch for the whole step.

- Uniform steps only: every sequence DECODE (1 token), or every sequence VERIFY with the same 1 + k tokens
  (k <= `max_draft_tokens`). Mixed steps and prefill chunks run eagerly.
- Batch buckets: a step of n sequences replays the graph of the smallest bucket >= n; graphs are captured on
  first use (largest memory first is not needed: one pool is shared and replays never overlap).
- Static inputs: the graph reads the runner's preallocated buffers (`runner.StepBuffers`: ids, positions,
  cu_seqlens, block table, cache lengths, token slots, state slots). `ModelRunner.prepare` fills the first n
  rows; the padding rows are refilled on every replay so they address only a scratch sequence the graphs own (one
  cache page, one state slot): a padded row never reads or writes a live sequence's page or state.
- Every launch decision inside the step comes from shapes fixed at capture (the bucket, the block-table width,
  the cache's dtype and page size), never from the step's lengths, which the kernels read on the device; so a
  graph captured once is valid for any lengths up to the block table's capacity. Nothing in the step reads a
  device value on the host; the logits stay in the graph's output buffer until the next replay.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from ..modeling.batch import ForwardBatch, Phase
from .cache import CacheView
from .runner import ModelRunner, RunnerOutput, StepInputs
from .scheduler import ScheduledStep

logger = logging.getLogger(__name__)

__all__ = ["SCRATCH_SEQ_ID", "GraphKey", "StepGraphs", "default_buckets"]

# The ledger entry of the graphs' scratch sequence (request ids are >= 0).
SCRATCH_SEQ_ID = -1
# The token id padding rows feed (any valid id; its output is never sampled).
PAD_TOKEN_ID = 0


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes with a graph: powers of two up to 8, then steps of 8 to 64, of 32 to 256, of 64 beyond (as
    vLLM/SGLang bucket them: padding waste stays under ~12% above 64)."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, 257, 32), *range(320, 1025, 64)]
    capped = [s for s in sizes if s < max_num_seqs]
    return (*capped, max_num_seqs)


@dataclass(frozen=True)
class GraphKey:
    """One captured step shape: its phase, the bucket (sequences) and the new tokens per sequence."""

    phase: Phase
    batch: int
    tokens_per_seq: int

    @property
    def num_tokens(self) -> int:
        return self.batch * self.tokens_per_seq


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly from the static buffers (`use_graphs=False`)
    logits: torch.Tensor  # [num_tokens, V] fp32, the graph's output buffer
    pad_positions: torch.Tensor  # [num_tokens] position of each token within its (padding) sequence
    pad_slots: torch.Tensor  # [num_tokens] the scratch page's slots those positions write
    pad_cu_seqlens: torch.Tensor  # [batch + 1] cu_seqlens of a uniform step of this shape


class StepGraphs:
    """Captured decode and verify steps of one `ModelRunner`.

    Args:
        runner: the runner whose `forward` and buffers are captured (CUDA only).
        buckets: batch sizes to capture (default `default_buckets`), capped by the runner's buffers.
        max_draft_tokens: the largest k of a verify step taken by a graph.
        use_graphs: False runs each padded bucket-shaped step eagerly from the same static buffers instead of
            replaying a graph (any device): a graph's exact inputs without capture, to tell a capture problem from
            a padding problem, and what the CPU tests check the padding with.

    Reserves a scratch sequence in the runner's ledger (one state slot, one page): the engine sizes its ledger
    one slot and one page above what requests may use.
    """

    def __init__(
        self,
        runner: ModelRunner,
        buckets: tuple[int, ...] | None = None,
        max_draft_tokens: int = 8,
        use_graphs: bool = True,
    ):
        if use_graphs and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        if not isinstance(max_draft_tokens, int) or max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be an int >= 0, got {max_draft_tokens!r}")
        b = runner.buffers
        self.max_seqs, self.max_tokens = b.cu_seqlens.shape[0] - 1, b.input_ids.shape[0]
        ledger = runner.cache.ledger
        if max_draft_tokens + 1 > ledger.page_size:
            raise ValueError(f"max_draft_tokens + 1 = {max_draft_tokens + 1} must fit one page ({ledger.page_size})")
        self.runner = runner
        self.max_draft_tokens = max_draft_tokens
        self.buckets = tuple(sorted(s for s in (buckets or default_buckets(self.max_seqs)) if s <= self.max_seqs))
        if not self.buckets:
            raise ValueError(f"no bucket fits the runner's {self.max_seqs} sequences")
        scratch = ledger.admit(SCRATCH_SEQ_ID, max_draft_tokens + 1)
        self.scratch_page, self.scratch_slot = scratch.pages[0], scratch.slot
        runner.cache.reset_state(self.scratch_slot)
        # every logit row of a uniform step, in packed order (ModelRunner._logit_tokens for decode and verify)
        self.rows = torch.arange(self.max_tokens, device=runner.device)
        self.use_graphs = use_graphs
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.graphs: dict[GraphKey, _Captured] = {}
        self.uncapturable: dict[GraphKey, str] = {}  # shapes whose forward syncs with the host, and why

    # ---------------------------------------------------------------- dispatch
    def key_for(self, step: ScheduledStep) -> GraphKey | None:
        """The graph shape that serves `step`, or None when it must run eagerly (mixed phases, prefill, verify
        groups of unequal or too many drafts, more sequences or tokens than the largest bucket)."""
        phase = step.phases[0] if step.phases else Phase.PREFILL
        if phase is Phase.PREFILL or any(p is not phase for p in step.phases):
            return None
        q = len(step.token_ids[0])
        if any(len(t) != q for t in step.token_ids) or q > self.max_draft_tokens + 1:
            return None
        i = bisect.bisect_left(self.buckets, len(step.requests))
        if i == len(self.buckets) or self.buckets[i] * q > self.max_tokens:
            return None
        return GraphKey(phase, self.buckets[i], q)

    def run(self, step: ScheduledStep) -> RunnerOutput | None:
        """Replay the graph for `step` (capturing it on first use); None when the step has no graph shape or its
        forward cannot be captured (see `capture`)."""
        key = self.key_for(step)
        if key is None or key in self.uncapturable:
            return None
        captured = self.graphs.get(key) or self.capture(key)
        if captured is None:
            return None
        inputs, rows = self.runner.prepare(step)
        self._pad(key, captured, len(step.requests))
        if captured.graph is None:
            with torch.no_grad():
                captured.logits = self.runner.forward(self._inputs(key))
        else:
            captured.graph.replay()
        inputs.view.commit(inputs.batch)
        return RunnerOutput(captured.logits[: step.total_tokens], rows)

    # ---------------------------------------------------------------- capture
    def capture(self, key: GraphKey) -> _Captured | None:
        """Warm up (compiles every Triton kernel at these shapes) and capture one step shape; every row is a
        padding row meanwhile, so capture writes only the scratch sequence.

        The first warm-up pass runs with synchronising CUDA calls made errors: a step that reads device values on
        the host (a torch reference kernel chosen by the backend switch, say) cannot be replayed, so its shape is
        recorded in `uncapturable` (with the reason) and runs eagerly. Returns None then."""
        device, q = self.runner.device, key.tokens_per_seq
        positions = torch.arange(key.num_tokens, device=device) % q
        page_size = self.runner.cache.ledger.page_size
        captured = _Captured(
            graph=torch.cuda.CUDAGraph() if self.use_graphs else None,
            logits=torch.empty(0),
            pad_positions=positions,
            pad_slots=self.scratch_page * page_size + positions,
            pad_cu_seqlens=torch.arange(key.batch + 1, dtype=torch.int32, device=device) * q,
        )
        if captured.graph is None:
            self.graphs[key] = captured
            return captured
        self._pad(key, captured, 0)
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
            with torch.no_grad(), torch.cuda.graph(captured.graph, pool=self.pool):
                captured.logits = self.runner.forward(inputs)
        except RuntimeError as err:
            torch.cuda.current_stream(device).wait_stream(side)
            self.uncapturable[key] = str(err)
            logger.warning("no CUDA graph for %s, it runs eagerly: %s", key, err)
            return None
        self.graphs[key] = captured
        return captured

    def _inputs(self, key: GraphKey) -> StepInputs:
        """The runner's buffers as a step of `key`'s full shape: what the captured forward reads."""
        b, n, t = self.runner.buffers, key.batch, key.num_tokens
        batch = ForwardBatch(
            seq_lens=[key.tokens_per_seq] * n,
            context_lens=[0] * n,
            cu_seqlens=b.cu_seqlens[: n + 1],
            positions=b.positions[:t],
            phases=[key.phase] * n,
        )
        view = CacheView(
            self.runner.cache,
            [SCRATCH_SEQ_ID] * n,
            b.block_table[:n],
            b.state_indices[:n],
            cache_seqlens=b.cache_seqlens[:n],
            slot_mapping=b.slot_mapping[:t],
            backend=self.runner.attention_backend,
        )
        return StepInputs(b.input_ids[:t], batch, view, self.rows[:t])

    def _pad(self, key: GraphKey, captured: _Captured, num_seqs: int) -> None:
        """Point rows num_seqs.. of the bucket at the scratch sequence: the padded sequences hold only their own
        new tokens, at the scratch page's first slots, and share the scratch state slot."""
        n, t0 = num_seqs, num_seqs * key.tokens_per_seq
        if n == key.batch:
            return
        b = self.runner.buffers
        b.input_ids[t0 : key.num_tokens].fill_(PAD_TOKEN_ID)
        b.positions[t0 : key.num_tokens].copy_(captured.pad_positions[t0:])
        b.slot_mapping[t0 : key.num_tokens].copy_(captured.pad_slots[t0:])
        b.cu_seqlens[n + 1 : key.batch + 1].copy_(captured.pad_cu_seqlens[n + 1 :])
        b.cache_seqlens[n : key.batch].fill_(key.tokens_per_seq)
        b.state_indices[n : key.batch].fill_(self.scratch_slot)
        b.block_table[n : key.batch].fill_(self.scratch_page)
