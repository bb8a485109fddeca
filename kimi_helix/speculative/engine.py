"""`SpeculativeDecoder`: what `LLM` calls around each step when speculative decoding is on.

Before a step it asks the proposer for drafts for every decoding request (`Request.draft_token_ids`, which the
scheduler turns into a verify group). After the runner it feeds the proposer the captured target features of
every token the step ran, verifies each verify group (greedy exact match, or rejection sampling against the
draft distributions), and after the engine rolls the cache back it crops the proposer's context the same way.
It also keeps the acceptance metrics: tau (tokens per verify round, the bonus included) and acceptance by
position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..kernels.backends import dtype_name
from ..modeling.config import KimiK3Config
from .dspark.capture import TargetFeatureCapture
from .dspark.config import DSparkConfig
from .dspark.model import DSparkDrafter
from .proposers import DSparkProposer, NgramProposer, Proposal, ProposalRequest, Proposer
from .validator import Reason, SpeculativeConfig, UnsupportedConfigError, validate_speculative_config
from .verification import VerifyResult, verify


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
    """Drives a `Proposer` for an engine whose target is `model`, drafting `num_tokens` per request and step."""

    def __init__(self, model, proposer: Proposer, num_tokens: int):
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.metrics = SpeculativeMetrics()
        self._proposals: dict[int, Proposal] = {}
        self.capture = (
            TargetFeatureCapture(model, proposer.target_layer_ids).attach() if proposer.target_layer_ids else None
        )

    def propose(self, requests: Sequence) -> None:
        """Give every decoding request (its prompt done) drafts for the next step."""
        ready = [r for r in requests if not r.prefilling and r.num_computed == len(r.token_ids) - 1]
        limit = {r.request_id: min(self.num_tokens, r.params.max_tokens - len(r.output_ids) - 1) for r in ready}
        ready = [r for r in ready if limit[r.request_id] > 0]
        asks = [
            ProposalRequest(r.request_id, r.token_ids, limit[r.request_id], r.params.temperature, r.generator)
            for r in ready
        ]
        for r, proposal in zip(ready, self.proposer.propose(asks)):
            self._proposals[r.request_id] = proposal
            r.draft_token_ids = list(proposal.token_ids)

    def observe(self, step) -> None:
        """Hand the proposer the captured features of every token of `step` (call right after the runner)."""
        if self.capture is None:
            return
        features = self.capture.pop()
        start = 0
        for r, n in zip(step.requests, step.num_tokens):
            self.proposer.observe(r.request_id, r.num_computed, features[start : start + n])
            start += n

    def verify(self, request, drafts: list[int], logits: torch.Tensor) -> VerifyResult:
        """Verify one request's verify group: drafts (the k the scheduler kept) and its k+1 logit rows."""
        proposal = self._proposals.pop(request.request_id, None)
        probs = None if proposal is None or proposal.probs is None else proposal.probs[: len(drafts)]
        result = verify(drafts, probs, logits, request.params, request.generator)
        self.metrics.add(len(drafts), result.num_accepted)
        return result

    def rollback(self, request, num_keep: int) -> None:
        self.proposer.rollback(request.request_id, num_keep)

    def release(self, request) -> None:
        self._proposals.pop(request.request_id, None)
        self.proposer.release(request.request_id)


def _target_config(model):
    """The target's config without loading weights: a loaded model's, or a checkpoint folder's config.json."""
    if isinstance(model, (str, Path)):
        return KimiK3Config.from_pretrained(Path(model))
    return model.config


def check_speculative_config(spec, model, proposer, dtype, device, kv_cache_dtype, attention_backend):
    """Validate `spec` for `LLM` before any weights load (reads the target's and the drafter's config.json only).

    Returns the `SpeculativeConfig`; raises `UnsupportedConfigError` with every reason."""
    spec = dict(spec or {})
    if proposer is not None and spec.get("method") != "custom":
        raise UnsupportedConfigError([Reason("method", "a proposer= is given", "method='custom'")])
    if spec.get("method") == "custom" and proposer is None:
        raise UnsupportedConfigError([Reason("method", "'custom' needs proposer=", "LLM(..., proposer=...)")])
    if attention_backend is not None:
        spec.setdefault("attention_backend", attention_backend)
    target = _target_config(model)
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
        device=device.type,
        dtype=dtype_name(dtype),
        kv_dtype=kv,
        custom_proposer=proposer is not None,
    )


def build_speculative_decoder(spec: SpeculativeConfig, model, proposer, device) -> SpeculativeDecoder:
    """The proposer `spec` names (the given one for "custom"), wired to the loaded target `model`."""
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "dspark":
        drafter = DSparkDrafter.from_pretrained(spec.model, dtype=model.dtype, device=device)
        drafter.bind_target(model)
        proposer = DSparkProposer(drafter)
    return SpeculativeDecoder(model, proposer, spec.num_speculative_tokens)
