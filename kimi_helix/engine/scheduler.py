"""Continuous batching: requests join and leave the running batch between steps.

Each step declares, for every running request, its phase and its new tokens, within the token budget
`max_num_batched_tokens` (B):

1. Every running request gets one token first: a decode its token, a verify group its last sampled token, a
   prefilling request the first token of its chunk. At most min(max_num_seqs, B) requests run, so this always fits
   and no running request ever gets zero tokens in a step - except one whose last token by `max_tokens` is still
   on the device (asynchronous scheduling, `engine.async_scheduling`): it has nothing left to compute.
2. The rest of B goes to verify drafts (decoding requests with `draft_token_ids`), in running order: a group of
   1 + k tokens, k cut to what the budget and the request's remaining `max_tokens` allow.
3. What is left goes to prefill chunks in arrival order, each taking as much of its remaining prompt as fits
   (chunked prefill: a long prompt never takes the budget from running decodes).

The step lists decodes and verify groups before prefill chunks. A request is admitted, in arrival order, only
when the ledger can give it a state slot and reserve every page it may need (prompt + max_tokens - 1 tokens; the
pages are mapped as its cached length grows, by the runner before each step writes them), so running requests
never wait for pages; a request that does not fit yet blocks the ones behind it (no starvation).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..modeling.batch import Phase
from .cache import PageLedger
from .sampling import Logprob, SamplingParams


@dataclass
class RequestMetrics:
    """When a request arrived, when the host read its first generated token, and when it finished (`time.perf_counter`
    seconds; None until then). `finished_time - first_token_time` is its decoding phase, which the token count
    less one divides into the time per output token."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Request:
    request_id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV/state is in the cache
    finish_reason: str | None = None
    text: str = ""
    # Draft tokens to verify after the last sampled one (set by a speculative proposer; empty normally).
    draft_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def pending(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed

    @property
    def reserve_tokens(self) -> int:
        # The last sampled token is never fed back, so the cache holds at most prompt + max_tokens - 1 tokens.
        return len(self.prompt_ids) + self.params.max_tokens - 1


@dataclass
class ScheduledStep:
    """One step: per scheduled request (decodes and verify groups first, then prefill chunks) its phase and new
    token ids. A verify group's tokens are the last sampled token followed by its drafts."""

    requests: list[Request]
    phases: list[Phase]
    token_ids: list[list[int]]

    @property
    def num_tokens(self) -> list[int]:
        return [len(t) for t in self.token_ids]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, ledger: PageLedger, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.ledger = ledger
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Raise ValueError if `request` could never run, naming the limit it exceeds."""
        need = len(request.prompt_ids) + request.params.max_tokens
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if need > self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                f"({request.params.max_tokens}) = {need} exceeds max_model_len={self.max_model_len}"
            )
        pages = self.ledger.pages_for(request.reserve_tokens)
        if pages > self.ledger.num_pages:
            raise ValueError(
                f"request {request.request_id}: needs {pages} cache pages of {self.ledger.page_size} tokens but the "
                f"cache has only {self.ledger.num_pages} pages in total"
            )

    def schedule(self) -> ScheduledStep:
        """Admit what fits, then split the token budget as the module docstring says."""
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        while self.waiting and len(self.running) < limit and self.ledger.can_admit(self.waiting[0].reserve_tokens):
            request = self.waiting.popleft()
            self.ledger.admit(request.request_id, request.reserve_tokens)
            self.running.append(request)
        # A request whose pending token is its last by max_tokens (a step in flight sampled it, under asynchronous
        # scheduling) has nothing left to compute: it finishes when that token is read.
        decoding = [r for r in self.running if not r.prefilling and len(r.output_ids) < r.params.max_tokens]
        prefilling = [r for r in self.running if r.prefilling]
        budget = self.max_num_batched_tokens - len(decoding) - len(prefilling)  # one token each is granted
        step = ScheduledStep([], [], [])
        for r in decoding:
            # The cache holds at most reserve_tokens: drafts past the last token max_tokens allows are never used.
            k = min(len(r.draft_token_ids), budget, r.reserve_tokens - r.num_computed - 1)
            budget -= k
            step.requests.append(r)
            step.phases.append(Phase.VERIFY if k > 0 else Phase.DECODE)
            # from output_ids: `token_ids` would copy the whole prompt for every decode of every step
            step.token_ids.append([r.output_ids[r.num_computed - len(r.prompt_ids)], *r.draft_token_ids[:k]])
        for r in prefilling:
            n = 1 + min(len(r.prompt_ids) - r.num_computed - 1, budget)
            budget -= n - 1
            step.requests.append(r)
            step.phases.append(Phase.PREFILL)
            step.token_ids.append(r.prompt_ids[r.num_computed : r.num_computed + n])
        return step

    def finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self.running.remove(request)
        self.ledger.release(request.request_id)

    def abort(self, request: Request) -> None:
        """Drop `request` wherever it is (waiting or running) and free its pages and slot; finish_reason "abort"."""
        request.finish_reason = "abort"
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        if request.request_id in self.ledger.seqs:
            self.ledger.release(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
