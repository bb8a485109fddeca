"""`ModelRunner`: one scheduled step in, logits at the requested positions out.

The runner owns preallocated device buffers for every per-step input (token ids, positions, cu_seqlens, the block
table, cache lengths, token slots, KDA state slots and the logit row index). `prepare` fills them from the
scheduler's host-side step; `forward` reads only those buffers, so a decode or verify step of a fixed batch shape
always sees the same tensors and can be captured once and replayed.

Logit rows per scheduled request (`RunnerOutput.rows`): its last token for a decode or a final prefill chunk, every
token of a verify group (row i = the distribution after token i of the group), every token of a prefill chunk when
the request asks for `prompt_logprobs`, and none for an intermediate prefill chunk otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling.batch import ForwardBatch, Phase
from .cache import CacheView, PagedCache
from .scheduler import ScheduledStep


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


class StepBuffers:
    """Static device buffers sized for the largest step (`max_tokens` tokens of `max_seqs` sequences)."""

    def __init__(self, max_seqs: int, max_tokens: int, max_pages: int, device):
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_tokens)
        self.positions = zeros(max_tokens)
        self.slot_mapping = zeros(max_tokens)
        self.logits_index = zeros(max_tokens)
        self.cu_seqlens = zeros(max_seqs + 1, dtype=torch.int32)
        self.cache_seqlens = zeros(max_seqs, dtype=torch.int32)
        self.state_indices = zeros(max_seqs)
        self.block_table = zeros(max_seqs, max_pages, dtype=torch.int32)


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
        self.buffers = StepBuffers(max_num_seqs, max_num_tokens, max_pages_per_seq, self.device)
        # `cuda_graph.StepGraphs` over this runner, set by the engine on CUDA: replays uniform decode/verify steps
        self.graphs = None

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

    def prepare(self, step: ScheduledStep) -> tuple[StepInputs, list[slice]]:
        """Fill the buffers for `step` and return views of them plus each request's logit rows."""
        reqs, n_seqs, n_tok = step.requests, len(step.requests), step.total_tokens
        ps = self.cache.ledger.page_size
        contexts = [r.num_computed for r in reqs]
        ids, positions, slots, rows, index = [], [], [], [], []
        for r, tokens, ctx, phase in zip(reqs, step.token_ids, contexts, step.phases):
            pages = self.cache.ledger.seqs[r.request_id].pages
            start = len(ids)
            ids.extend(tokens)
            for p in range(ctx, ctx + len(tokens)):
                positions.append(p)
                slots.append(pages[p // ps] * ps + p % ps)
            wanted = self._logit_tokens(r, phase, ctx, len(tokens))
            rows.append(slice(len(index), len(index) + len(wanted)))
            index.extend(start + j for j in wanted)
        b = self.buffers
        cu = [0]
        for n in step.num_tokens:
            cu.append(cu[-1] + n)
        self._fill(b.input_ids, ids)
        self._fill(b.positions, positions)
        self._fill(b.slot_mapping, slots)
        self._fill(b.logits_index, index)
        self._fill(b.cu_seqlens, cu)
        self._fill(b.cache_seqlens, [c + n for c, n in zip(contexts, step.num_tokens)])
        self._fill(b.state_indices, [self.cache.ledger.seqs[r.request_id].slot for r in reqs])
        seq_ids = [r.request_id for r in reqs]
        b.block_table[:n_seqs].copy_(self.cache.block_table(seq_ids, b.block_table.shape[1]), non_blocking=True)
        batch = ForwardBatch(
            seq_lens=step.num_tokens,
            context_lens=contexts,
            cu_seqlens=b.cu_seqlens[: n_seqs + 1],
            positions=b.positions[:n_tok],
            phases=list(step.phases),
        )
        view = CacheView(
            self.cache,
            seq_ids,
            b.block_table[:n_seqs],
            b.state_indices[:n_seqs],
            cache_seqlens=b.cache_seqlens[:n_seqs],
            slot_mapping=b.slot_mapping[:n_tok],
            backend=self.attention_backend,
        )
        return StepInputs(b.input_ids[:n_tok], batch, view, b.logits_index[: len(index)]), rows

    @staticmethod
    def _logit_tokens(request, phase: Phase, context: int, n: int) -> range:
        """Which of the request's `n` new tokens need logits (indices into its tokens)."""
        if phase is not Phase.PREFILL:
            return range(n)  # a decode's token, or every token of a verify group
        if request.params.prompt_logprobs is not None:
            return range(n)
        return range(n - 1, n) if context + n == len(request.prompt_ids) else range(0)

    @staticmethod
    def _fill(buffer: torch.Tensor, values: list[int]) -> None:
        if values:
            host = torch.tensor(values, dtype=buffer.dtype)
            buffer[: len(values)].copy_(host, non_blocking=True)
