"""Asynchronous scheduling: the host schedules and launches step N + 1 while the device still runs step N.

A synchronous step waits for its sampled tokens before the next one is scheduled, so the device idles while the
host reads them, appends them, checks the stop conditions, schedules, stages and launches the next step: a few
tenths of a millisecond a step, a tenth of a 27-layer decode step at batch 1. Here (vLLM's `async_scheduling`,
SGLang's overlap scheduler) a step is launched before its requests' newest tokens reach the host:

- a sampled token is first a placeholder (`PLACEHOLDER`) in `Request.output_ids`; the next step's input row of
  that request is written on the device from the sampled tokens, after the step's upload (`runner.input_patch`);
- the tokens come back through pinned memory and an event; the host reads step N's after launching step N + 1,
  replaces the placeholders and checks EOS, stop tokens and stop strings;
- a request that stops at step N is already in step N + 1: that token is computed and dropped (the request's state
  slot is zeroed and its pages freed after step N + 1, in stream order). A request whose pending token is its last
  by `max_tokens` is not scheduled again: the host knows that without the token.

Steps in which the host must see the logits (logprobs, prompt_logprobs) or verify drafts run synchronously; the
engine first completes the step in flight (`drain`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .sampling import sample
from .scheduler import Request, ScheduledStep

__all__ = ["PLACEHOLDER", "AsyncScheduling", "TokenReadback"]

# A sampled token that is still on the device. Never a valid id: an input row left unpatched fails loudly on the
# CPU (embedding index -1) instead of running another token.
PLACEHOLDER = -1


class TokenReadback:
    """Sampled tokens copied to the host without waiting: two pinned buffers in turn, so step N's tokens are read
    while step N + 1's copy lands in the other. On the CPU the tokens are read at once."""

    def __init__(self, capacity: int, device: torch.device):
        self.device = device
        pinned = device.type == "cuda"
        self._host = [torch.empty(capacity, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0

    def start(self, tokens: torch.Tensor):
        """Begin copying `tokens` ([D] int64 on the device) to the host; returns a callable giving them as a list."""
        if self.device.type != "cuda":
            values = tokens.tolist()
            return lambda: values
        host = self._host[self._turn][: tokens.numel()]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read() -> list[int]:
            done.synchronize()
            return host.tolist()

        return read


@dataclass
class InFlight:
    """A launched step whose sampled tokens are still on the device: per sampled row, its request and the index of
    its placeholder in `output_ids`, the tokens [D] on the device, and the host read of them."""

    requests: list[Request]
    positions: list[int]
    tokens: torch.Tensor
    read: object  # () -> list[int], from `TokenReadback.start`
    source: dict[int, int]  # request id -> row of `tokens`


class AsyncScheduling:
    """Overlapped steps of one `LLM` (one process, no speculative decoding): `step` launches the next step, then
    completes the previous one; `drain` completes the step in flight."""

    def __init__(self, llm):
        self.llm = llm
        self.readback = TokenReadback(llm.scheduler.max_num_seqs, llm.device)
        self.in_flight: InFlight | None = None
        self._inputs_of: InFlight | None = None  # the step whose tokens the launching step reads on the device
        llm.runner.input_patch = self._patch_inputs

    def can_overlap(self) -> bool:
        """Whether the next step may be launched before the one in flight is read: no request asks for logprobs
        (their logits must be read between steps) and none has drafts to verify."""
        scheduler = self.llm.scheduler
        if any(r.draft_token_ids for r in scheduler.running):
            return False
        return not any(
            r.params.logprobs is not None or r.params.prompt_logprobs is not None
            for queue in (scheduler.running, scheduler.waiting)
            for r in queue
        )

    def step(self) -> int:
        """Schedule and launch a step, then complete the one before it. Returns how many requests finished."""
        start = time.perf_counter()
        previous, self.in_flight = self.in_flight, None
        step = self.llm.scheduler.schedule()
        if not step.requests and previous is None:
            raise RuntimeError("scheduler made no progress: no running request and none admissible")
        if step.requests:
            self.in_flight = self._launch(step, previous)
        finished, generated = self._complete(previous) if previous is not None else (0, 0)
        self.llm._record_step(start, step, generated)
        return finished

    def drain(self) -> int:
        """Complete the step in flight, if any. Returns how many requests finished."""
        previous, self.in_flight = self.in_flight, None
        return self._complete(previous)[0] if previous is not None else 0

    def discard(self) -> None:
        """Forget the step in flight (its requests are being aborted); the device finishes it in stream order."""
        self.in_flight = None

    def _launch(self, step: ScheduledStep, previous: InFlight | None) -> InFlight | None:
        """Run `step` with `previous`'s tokens patched into its input rows, sample it, start the token copy and
        put a placeholder for each sampled token."""
        llm = self.llm
        self._inputs_of = previous
        try:
            out = llm.runner.run(step)
        finally:
            self._inputs_of = None
        for r, n in zip(step.requests, step.num_tokens):
            r.num_computed += n
        picked = [
            (r, j)
            for r, phase, rows in zip(step.requests, step.phases, out.rows)
            for j in llm._sample_rows(r, phase, rows)
        ]
        if not picked:  # only intermediate prefill chunks
            return None
        rows = [j for _, j in picked]
        logits = out.logits
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows).to(logits.device, non_blocking=True)]
        requests = [r for r, _ in picked]
        tokens = sample(logits, [r.params for r in requests], [r.generator for r in requests])
        positions = []
        for r in requests:
            positions.append(len(r.output_ids))
            r.output_ids.append(PLACEHOLDER)
        source = {r.request_id: i for i, r in enumerate(requests)}
        return InFlight(requests, positions, tokens, self.readback.start(tokens), source)

    def _complete(self, done: InFlight) -> tuple[int, int]:
        """Read `done`'s tokens, put them in place of their placeholders and finish the requests that stop there.
        Returns (requests finished, tokens kept)."""
        finished = kept = 0
        for r, position, token in zip(done.requests, done.positions, done.read()):
            if r.finish_reason is not None:  # stopped at an earlier step: this token was computed past the end
                continue
            r.output_ids[position] = token
            kept += 1
            finished += self.llm._finish_if_done(r, position + 1)
        return finished, kept

    def _patch_inputs(self, step: ScheduledStep, input_ids: torch.Tensor) -> None:
        """The runner's `input_patch`: write the tokens of the step in flight into the uploaded input rows that hold
        their placeholders (input_ids [T] on the device)."""
        previous = self._inputs_of
        if previous is None:
            return
        dst, src, start = [], [], 0
        for r, ids in zip(step.requests, step.token_ids):
            if ids[0] == PLACEHOLDER:
                dst.append(start)
                src.append(previous.source[r.request_id])
            start += len(ids)
        if not dst:
            return
        n = len(dst)
        if dst[-1] - dst[0] == n - 1 and src[-1] - src[0] == n - 1:  # one run (steady decoding): a slice copy
            input_ids[dst[0] : dst[0] + n].copy_(previous.tokens[src[0] : src[0] + n])
            return
        index = torch.tensor([dst, src], dtype=torch.int64)
        if input_ids.device.type == "cuda":
            index = index.pin_memory()
        index = index.to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, index[0], previous.tokens.index_select(0, index[1]))
