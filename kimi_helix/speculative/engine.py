"""`SpeculativeDecoder`: what `LLM` calls around each step when speculative decoding is on.

Before a step it asks the proposer for drafts for every decoding request (`Request.draft_token_ids`, which the
scheduler turns into a verify group). After the runner it feeds the proposer the captured target features of
every token the step ran, verifies each verify group (greedy exact match, or rejection sampling against the
draft distributions), and after the engine rolls the cache back it crops the proposer's context the same way.
It also keeps the acceptance metrics: tau (tokens per verify round, the bonus included) and acceptance by
position.

Under tensor / Helix parallelism every rank runs the same decoder in lockstep (the drafter's embedding and LM head
are the target's vocab-parallel modules, so its forward is collective), and every rank continues with rank 0's
drafts and rank 0's verification results: one broadcast each per step, so unseeded sampling cannot make the ranks
disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..engine.runner import PAD_TOKEN_ID
from ..kernels.backends import dtype_name
from ..modeling.batch import Phase
from ..modeling.checkpoint import read_config
from .dspark.capture import TargetFeatureCapture
from .dspark.config import DSparkConfig
from .dspark.drafting import PinnedDownload, PinnedUpload
from .dspark.model import DSparkDrafter
from .proposers import DeviceDrafts, DSparkProposer, NgramProposer, Proposal, ProposalRequest, Proposer
from .scheduling import StepRateTable, cached_step_rate, confidence_schedule, profile_step_rate
from .validator import Reason, SpeculativeConfig, UnsupportedConfigError, validate_speculative_config
from .verification import VerifyResult, accept_greedy, verify


@dataclass
class SpeculativeMetrics:
    """rounds: verify rounds; emitted: tokens they emitted (accepted drafts + 1 each); proposed: drafts verified;
    accepted_at[j]: rounds whose draft j was accepted; proposed_at[j]: rounds that verified a draft j."""

    rounds: int = 0
    emitted: int = 0
    proposed: int = 0
    accepted_at: list[int] = field(default_factory=list)
    proposed_at: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens per verify round, the bonus (or correction) token included."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.rounds += 1
        self.emitted += num_accepted + 1
        self.proposed += num_drafts
        grow = num_drafts - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for j in range(num_drafts):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < num_accepted


class SpeculativeDecoder:
    """Drives a `Proposer` for an engine whose target is `model`, drafting `num_tokens` per request and step.

    With a `step_rate` table each step verifies the drafts Algorithm 1 admits from the proposals' confidences
    (`scheduling.confidence_schedule`, a draft token priced `token_weight` batch tokens: cp under Helix); without
    one, every proposed draft (fixed k). `comm`: the ranks' `Communicator` under tp * cp > 1, else None."""

    def __init__(
        self,
        model,
        proposer: Proposer,
        num_tokens: int,
        step_rate: StepRateTable | None = None,
        *,
        comm=None,
        token_weight: float = 1.0,
        max_tokens: int | None = None,
    ):
        self.proposer, self.num_tokens, self.step_rate = proposer, num_tokens, step_rate
        self.comm, self.token_weight = comm, token_weight  # the ranks' collectives; a draft token's batch price
        self.device = model.get_input_embeddings().weight.device
        self.metrics = SpeculativeMetrics()
        self._proposals: dict[int, Proposal] = {}
        self._on_device: DeviceDrafts | None = None  # this round's drafts left on the device, and their rows
        self._device_rows: dict[int, int] = {}
        self._patch = PinnedUpload(2, 64, self.device)  # (input row, draft index) pairs of a patch
        self._verified = PinnedDownload(self.device)  # a round's drafts and argmax rows, on their way to the host
        self._argmax = torch.zeros(0, dtype=torch.long, device=self.device)  # at fixed addresses (`draft_ahead`)
        self.capture = (
            TargetFeatureCapture(model, proposer.target_layer_ids, max_tokens).attach()
            if proposer.target_layer_ids
            else None
        )

    def propose(self, requests: Sequence) -> None:
        """Give every decoding request (its prompt done) drafts for the next step."""
        ready = [r for r in requests if not r.prefilling and r.pending == 1]  # the anchor alone not yet run
        limit = {r.request_id: min(self.num_tokens, r.params.max_tokens - len(r.output_ids) - 1) for r in ready}
        ready = [r for r in ready if limit[r.request_id] > 0]
        asks = [
            ProposalRequest(r.request_id, r.token_ids, limit[r.request_id], r.params.temperature, r.generator)
            for r in ready
        ]
        self._on_device = None
        if self.step_rate is None and self.comm is None:  # no host-side choice of lengths, no broadcast
            self._on_device = self.proposer.propose_on_device(asks)
        if self._on_device is not None:
            # Placeholders until `verify_groups` reads the drafts: `patch_inputs` writes the real ones on the device.
            self._device_rows = {r.request_id: i for i, r in enumerate(ready)}
            for r, n in zip(ready, self._on_device.counts):
                r.draft_token_ids = [PAD_TOKEN_ID] * n
            return
        proposals = self.proposer.propose(asks)
        lengths = [len(p.token_ids) for p in proposals]
        if self.step_rate is not None:
            confidences = [p.confidence or [] for p in proposals]
            lengths = confidence_schedule(confidences, self.step_rate, token_weight=self.token_weight)
        drafts = self._agree([list(p.token_ids[:n]) for p, n in zip(proposals, lengths)])
        for r, proposal, tokens in zip(ready, proposals, drafts):
            self._proposals[r.request_id] = proposal
            r.draft_token_ids = tokens

    def patch_inputs(self, step, input_ids: torch.Tensor) -> None:
        """The runner's `input_patch`: write this round's device drafts into their verify groups' rows of the
        uploaded input_ids [T] (the scheduler's step holds placeholders there until `verify_groups`)."""
        drafts = self._on_device
        if drafts is None:
            return
        k, dst, src = drafts.tokens.shape[1], [], []
        for _, row, start, n in self._device_groups(step):
            dst += range(start + 1, start + 1 + n)
            src += range(row * k, row * k + n)
        if not dst:
            return
        if dst[-1] - dst[0] == len(dst) - 1 and src[-1] - src[0] == len(src) - 1:  # one run (batch 1): a slice
            input_ids[dst[0] : dst[-1] + 1].copy_(drafts.tokens.view(-1)[src[0] : src[-1] + 1])
            return
        if self._patch.dev.shape[1] < len(dst):
            self._patch = PinnedUpload(2, max(len(dst), 2 * self._patch.dev.shape[1]), self.device)
        where = self._patch.put([dst, src])
        input_ids.index_copy_(0, where[0], drafts.tokens.view(-1).index_select(0, where[1]))

    def _read_back(self, step, best: torch.Tensor | None) -> list[int]:
        """Read this round's device drafts (if any) and the greedy groups' argmax rows `best` [R] (if any) in ONE
        copy to the host (the round's one sync: it also waits for the verify step queued after the drafts); the
        drafts replace their placeholders in `step`. Returns `best` on the host ([] without it).

        The next round's drafts are launched after the copy is queued and before the host waits for it
        (`_draft_ahead`), so the drafter runs while the host accepts, rolls back and stages the next step."""
        drafts, self._on_device = self._on_device, None
        parts = [t for t in (None if drafts is None else drafts.tokens.view(-1), best) if t is not None]
        if not parts:
            return []
        self._verified.fetch(parts[0] if len(parts) == 1 else torch.cat(parts))
        if drafts is not None and best is not None:
            self._draft_ahead(step, drafts, best)
        host = self._verified.result().tolist()
        if drafts is None:
            return host
        k, n = drafts.tokens.shape[1], drafts.tokens.numel()
        for i, row, _, m in self._device_groups(step):
            step.token_ids[i][1:] = host[row * k : row * k + m]
            step.requests[i].draft_token_ids = step.token_ids[i][1:]
        return host[n:]

    def _draft_ahead(self, step, drafts: DeviceDrafts, best: torch.Tensor) -> None:
        """`Proposer.draft_ahead` when `step` is exactly this round's verify groups, in their draft rows' order,
        each with all k drafts and greedy (so `best` [N * (k + 1)] is their argmax rows in order)."""
        n, k = drafts.tokens.shape
        if len(step.requests) != n or best.shape[0] != n * (k + 1):
            return
        for i, (request, phase, tokens) in enumerate(zip(step.requests, step.phases, step.token_ids)):
            row = self._device_rows.get(request.request_id)
            if phase is not Phase.VERIFY or row != i or len(tokens) != k + 1 or not request.params.greedy:
                return
        self.proposer.draft_ahead([r.request_id for r in step.requests], best.view(n, k + 1), drafts.tokens)

    def _device_groups(self, step):
        """(index in the step, row of this round's device drafts, first packed token, drafts kept) of each verify
        group whose drafts were left on the device."""
        start = 0
        for i, (request, phase, tokens) in enumerate(zip(step.requests, step.phases, step.token_ids)):
            row = self._device_rows.get(request.request_id)
            if row is not None and phase is Phase.VERIFY:
                yield i, row, start, len(tokens) - 1
            start += len(tokens)

    def observe(self, step) -> None:
        """Hand the proposer the captured features of every token of `step` (call right after the runner)."""
        if self.capture is None:
            return
        static = self.capture.buffer is not None
        features = self.capture.pop(step.total_tokens) if static else self.capture.pop()
        ids, starts = [r.request_id for r in step.requests], [r.num_computed for r in step.requests]
        self.proposer.observe_step(ids, starts, list(step.num_tokens), features)

    def verify_groups(self, step, out) -> dict[int, VerifyResult]:
        """Verify every verify group of `step` against the runner's output `out`: {index in the step: result}.

        A group's drafts are its tokens after the first (the k the scheduler kept); its k + 1 logit rows are the
        last of the request's rows."""
        groups = [i for i, phase in enumerate(step.phases) if phase is Phase.VERIFY]
        greedy = [i for i in groups if step.requests[i].params.greedy]
        best = self._read_back(step, self._greedy_argmax(step, out, greedy))
        results = dict(zip(greedy, self._accept_greedy(step, greedy, best)))
        for i in groups:
            request, drafts = step.requests[i], step.token_ids[i][1:]
            proposal = self._proposals.pop(request.request_id, None)
            if i in results:
                continue
            probs = None if proposal is None or proposal.probs is None else proposal.probs[: len(drafts)]
            logits = out.logits[out.rows[i]][-len(drafts) - 1 :]
            results[i] = verify(drafts, probs, logits, request.params, request.generator)
        results = [results[i] for i in groups]
        agreed = self._agree([r.tokens for r in results])
        results = [VerifyResult(tokens, len(tokens) - 1) for tokens in agreed]
        for i, result in zip(groups, results):
            self.metrics.add(len(step.token_ids[i]) - 1, result.num_accepted)
        return dict(zip(groups, results))

    def _greedy_argmax(self, step, out, groups: list[int]) -> torch.Tensor | None:
        """The argmax of every greedy group's rows, on the device ([R] int64, the groups' k + 1 rows in order: a
        group's rows are the last of its request's rows; in a buffer of fixed address, which the proposer's
        draft-ahead graph reads), or None without greedy groups."""
        if not groups:
            return None
        spans = [(out.rows[i].stop - len(step.token_ids[i]), out.rows[i].stop) for i in groups]
        ends = [0] + [b for _, b in spans]
        if all(a == end for (a, _), end in zip(spans, ends)) and ends[-1] == out.logits.shape[0]:
            rows = out.logits  # the groups' rows are all the rows, in order (a verify-only step): no gather
        else:
            index = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in spans]))
            rows = out.logits.index_select(0, index.to(out.logits.device, non_blocking=True))
        if self._argmax.numel() < rows.shape[0]:
            self._argmax = torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device)
        return torch.argmax(rows, dim=-1, out=self._argmax[: rows.shape[0]])  # the same argmax as `sample`

    @staticmethod
    def _accept_greedy(step, groups: list[int], best: list[int]) -> list[VerifyResult]:
        """`verify_greedy` for every greedy group from the host copy `best` of `_greedy_argmax`."""
        results, offset = [], 0
        for i in groups:
            n = len(step.token_ids[i])
            results.append(accept_greedy(step.token_ids[i][1:], best[offset : offset + n]))
            offset += n
        return results

    def _agree(self, token_lists: list[list[int]]) -> list[list[int]]:
        """Rank 0's `token_lists` on every rank (one broadcast); unchanged in one process. Every list holds at
        most num_tokens + 1 ids (drafts, or accepted drafts plus one)."""
        if self.comm is None or not token_lists:
            return token_lists
        packed = torch.zeros(len(token_lists), self.num_tokens + 2, dtype=torch.long)
        for row, tokens in zip(packed, token_lists):
            row[0] = len(tokens)
            row[1 : 1 + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        packed = self.comm.broadcast(packed.to(self.device)).tolist()
        return [row[1 : 1 + row[0]] for row in packed]

    def rollback(self, request, num_keep: int) -> None:
        self.proposer.rollback(request.request_id, num_keep)

    def release(self, request) -> None:
        self._proposals.pop(request.request_id, None)
        self.proposer.release(request.request_id)


def _target_config(model):
    """The target's config without loading weights: a loaded model's, or a checkpoint folder's config.json."""
    if isinstance(model, (str, Path)):
        return read_config(Path(model))  # validated, and no code from the folder
    return model.config


def check_speculative_config(spec, model, proposer, dtype, device, kv_cache_dtype, attention_backend, tp=1, cp=1):
    """Validate `spec` for `LLM` on a `tp` x `cp` layout before any weights load (reads the target's and the
    drafter's config.json only). DSpark without a `model` on the demo model uses the drafter shipped beside it.

    Returns the `SpeculativeConfig`; raises `UnsupportedConfigError` with every reason."""
    spec = dict(spec or {})
    if proposer is not None and spec.get("method") != "custom":
        raise UnsupportedConfigError([Reason("method", "a proposer= is given", "method='custom'")])
    if spec.get("method") == "custom" and proposer is None:
        raise UnsupportedConfigError([Reason("method", "'custom' needs proposer=", "LLM(..., proposer=...)")])
    if attention_backend is not None:
        spec.setdefault("attention_backend", attention_backend)
    target = _target_config(model)
    if spec.get("method") == "dspark" and spec.get("model") is None:
        from .. import assets  # the drafter shipped for the demo model, when the target is the demo model

        folder = model if isinstance(model, (str, Path)) else getattr(model, "name_or_path", None)
        default = assets.default_drafter_dir(folder)
        if default is not None:
            spec["model"] = str(default)
    drafter = None
    if spec.get("method") == "dspark" and spec.get("model") is not None:
        folder = Path(spec["model"])
        if not (folder / "config.json").is_file():
            raise UnsupportedConfigError([Reason("model", f"{folder} has no config.json", "a drafter folder")])
        drafter = DSparkConfig.from_pretrained(folder)
    if dtype is None:
        dtype = model.dtype if not isinstance(model, (str, Path)) else getattr(target, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    kv = "fp8_e4m3" if kv_cache_dtype == "fp8_e4m3" else dtype_name(dtype)
    return validate_speculative_config(
        spec,
        target,
        drafter,
        tp=tp,
        cp=cp,
        device=device.type,
        dtype=dtype_name(dtype),
        kv_dtype=kv,
        custom_proposer=proposer is not None,
    )


def build_speculative_decoder(spec: SpeculativeConfig, llm, proposer) -> SpeculativeDecoder:
    """The proposer `spec` names (the given one for "custom"), wired to `llm`'s loaded target; with confidence
    scheduling, the verify step's rate table, profiled on `llm` now (or read from `spec.step_rate_table`)."""
    model = llm.model
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "dspark":
        drafter = DSparkDrafter.from_pretrained(spec.model, dtype=model.dtype, device=llm.device)
        drafter.bind_target(model)
        drafter.set_backends(llm.backends)
        graphs = llm.runner.graphs is not None and llm.runner.graphs.use_graphs  # CUDA, one process, not eager
        proposer = DSparkProposer(drafter, llm.scheduler.max_num_seqs, use_graphs=graphs)
    rate = None
    if spec.confidence_scheduling:
        group = spec.num_speculative_tokens + 1
        ledger = llm.cache.ledger
        seqs = min(llm.scheduler.max_num_seqs, ledger.num_slots, ledger.num_pages // ledger.pages_for(group))
        limit = min(llm.scheduler.max_num_batched_tokens, seqs * group)
        sizes = sorted({1, limit, *(2**i for i in range(limit.bit_length()) if 2**i <= limit)})
        step = verify_step(llm, group)
        sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
        if spec.step_rate_table is None:
            rate = profile_step_rate(step, sizes, synchronize=sync)
        else:
            c, m = model.config, None if llm.comm is None else llm.comm.mapping
            layout = "" if m is None else f"-tp{m.tp}cp{m.cp}"  # each rank's step is its share of the layout's
            key = f"{c.model_type}-L{c.num_hidden_layers}-d{c.hidden_size}-{llm.device.type}-{model.dtype}-g{group}"
            save = m is None or m.rank == 0
            rate = cached_step_rate(spec.step_rate_table, key + layout, step, sizes, save=save, synchronize=sync)
    cp = 1 if llm.comm is None else llm.comm.mapping.cp
    max_tokens = llm.runner.buffers.max_tokens if proposer.target_layer_ids else None  # the capture's rows
    decoder = SpeculativeDecoder(
        model,
        proposer,
        spec.num_speculative_tokens,
        rate,
        comm=llm.comm,
        token_weight=cp,
        max_tokens=max_tokens,
    )
    llm.runner.input_patch = decoder.patch_inputs
    return decoder


def verify_step(llm, group: int):
    """A step callable for `profile_step_rate`: one runner step of `tokens` tokens in verify groups of `group`
    (the last one shorter) over fresh zero-context sequences, admitted and released around it."""
    from ..engine.sampling import SamplingParams
    from ..engine.scheduler import Request, ScheduledStep

    def step(tokens: int) -> None:
        sizes = [group] * (tokens // group) + ([tokens % group] if tokens % group else [])
        reqs = [Request(-1 - i, None, [0], SamplingParams(max_tokens=group), None) for i in range(len(sizes))]
        ledger = llm.cache.ledger
        for r in reqs:
            ledger.admit(r.request_id, group)
        try:
            phases = [Phase.VERIFY if n > 1 else Phase.DECODE for n in sizes]
            llm.runner.run(ScheduledStep(reqs, phases, [[0] * n for n in sizes]))
        finally:
            for r in reqs:
                llm.cache.reset_state(ledger.seqs[r.request_id].slot)
                ledger.release(r.request_id)
        llm.cache.verify_records = {}

    return step
