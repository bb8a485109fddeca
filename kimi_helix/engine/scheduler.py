"""Continuous batching: requests join and leave the running batch between steps.

Each step schedules, for every running request, its pending tokens: one for a decoding request, a chunk of the
prompt for a prefilling one, decodes first so that a long prompt never stalls them, within a token budget. A
request is admitted only when the ledger can give it a state slot and every page it may need (prompt +
max_tokens), so running requests never wait for pages; new requests wait until finished ones free theirs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .cache import PageLedger
from .sampling import SamplingParams


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
    requests: list[Request]
    num_tokens: list[int]  # new tokens per request, in order

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
        # Admit in arrival order; a request that does not fit yet blocks the ones behind it (no starvation).
        while (
            self.waiting
            and len(self.running) < self.max_num_seqs
            and self.ledger.can_admit(self.waiting[0].reserve_tokens)
        ):
            request = self.waiting.popleft()
            self.ledger.admit(request.request_id, request.reserve_tokens)
            self.running.append(request)
        budget = self.max_num_batched_tokens
        chosen, counts = [], []
        for request in sorted(self.running, key=lambda r: r.pending > 1):  # decodes first
            n = min(request.pending, budget)
            if n > 0:
                chosen.append(request)
                counts.append(n)
                budget -= n
        return ScheduledStep(chosen, counts)

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
