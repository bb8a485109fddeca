"""`LLM`: offline batched generation with the shape of vLLM's API, on the paged hybrid cache."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..kernels.backends import build_registry
from ..kernels.launch import cdiv
from ..modeling.batch import Phase
from ..modeling.model import KimiK3ForCausalLM
from .cache import PagedCache, PageLedger
from .cuda_graph import StepGraphs
from .runner import ModelRunner
from .sampling import Logprob, SamplingParams, logprobs_of, make_generator, sample
from .scheduler import Request, Scheduler


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) or "length"
    # With SamplingParams.logprobs: one dict per generated token (the chosen token always in it).
    logprobs: list[dict[int, Logprob]] | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token; entry 0 is None, entry j holds prompt token j
    # given the tokens before it.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepMetrics:
    step: int
    seconds: float
    scheduled_tokens: int
    generated_tokens: int
    running: int
    waiting: int
    pages_in_use: int

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class LLM:
    """Batched generation over a paged MLA latent cache and a KDA state pool.

    Args:
        model: a checkpoint directory or a loaded `KimiK3ForCausalLM`.
        dtype, device: default to the model's (a directory loads in its saved dtype; cuda if available).
        page_size: tokens per cache page. max_num_seqs: running sequences at most (= state slots).
        max_model_len: prompt + generated tokens per request at most (default: the config's, capped at 8192).
        kv_cache_dtype: "auto" (model dtype) or "fp8_e4m3" (per-token scaled e4m3 latents).
        gpu_memory_utilization: share of free GPU memory the cache may take (CUDA only).
        attention_backend: None (automatic: the first backend whose declared capabilities serve each call), or
            "torch", "triton", "sdpa" to force one (a forced backend that cannot serve a call raises).
        num_pages: cache pages; default sized from free GPU memory, or for 8 full-length sequences on CPU.
        max_num_batched_tokens: token budget per step (chunked prefill); default 2048.
        enforce_eager: run every step eagerly; by default on CUDA uniform decode and verify steps replay CUDA
            graphs (`engine.cuda_graph`), which reserve one extra state slot and cache page for padding rows.
    """

    def __init__(
        self,
        model,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        page_size: int = 64,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        attention_backend: str | None = None,
        num_pages: int | None = None,
        max_num_batched_tokens: int = 2048,
        tokenizer=None,
        enforce_eager: bool = False,
    ):
        if attention_backend is not None and attention_backend not in build_registry():
            raise ValueError(
                f"attention_backend must be None (automatic) or one of {sorted(build_registry())}, "
                f"got {attention_backend!r}"
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        for name, value in (
            ("page_size", page_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, (str, Path)):
            path = Path(model)
            model = KimiK3ForCausalLM.from_pretrained(path, dtype=dtype, device=device)
            if tokenizer is None and (path / "tokenizer_config.json").is_file():
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
        self.model.eval()
        self.tokenizer = tokenizer
        self.attention_backend = attention_backend
        self.device = device
        config = self.model.config
        self.max_model_len = max_model_len or min(config.model_max_length, 8192)
        if num_pages is None:
            num_pages = self._default_num_pages(page_size, max_num_seqs, kv_cache_dtype, gpu_memory_utilization)
        use_graphs = device.type == "cuda" and not enforce_eager
        ledger = PageLedger(num_pages + use_graphs, page_size, max_num_seqs + use_graphs)
        self.cache = PagedCache(config, ledger, self.model.dtype, device, kv_cache_dtype)
        self.scheduler = Scheduler(ledger, max_num_seqs, max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(
            self.model,
            self.cache,
            device,
            max_num_seqs=max_num_seqs,
            max_num_tokens=max_num_batched_tokens,
            max_pages_per_seq=cdiv(self.max_model_len, page_size),
            attention_backend=attention_backend,
        )
        if use_graphs:
            self.runner.graphs = StepGraphs(self.runner)
        self.metrics: list[StepMetrics] = []
        self._next_id = 0

    def _default_num_pages(self, page_size, max_num_seqs, kv_cache_dtype, utilization) -> int:
        """Pages for `max_num_seqs` full-length sequences at most; on CUDA also at most what fits in
        `utilization` of the free memory after the KDA state pool (weights are already resident)."""
        per_seq = cdiv(self.max_model_len, page_size)
        wanted = per_seq * max_num_seqs if self.device.type == "cuda" else per_seq * min(max_num_seqs, 8)
        if self.device.type != "cuda":
            return wanted
        from ..modeling.accounting import kda_state_bytes_per_sequence, mla_cache_bytes_per_token

        config, itemsize = self.model.config, self.model.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(self.device)
        # fp8 pages store one byte per value plus a per-token fp32 scale per MLA layer.
        token_bytes = mla_cache_bytes_per_token(config, 1 if kv_cache_dtype == "fp8_e4m3" else itemsize)
        if kv_cache_dtype == "fp8_e4m3":
            token_bytes += 4 * config.layer_types.count("full_attention")
        state_bytes = kda_state_bytes_per_sequence(config, itemsize) * max_num_seqs
        budget = int(free * utilization) - state_bytes
        fits = budget // max(1, token_bytes * page_size)
        if fits < per_seq:
            raise ValueError(
                f"gpu_memory_utilization={utilization} of {free / 2**30:.1f} GiB free leaves room for {max(fits, 0)} "
                f"cache pages of {page_size} tokens; one max_model_len={self.max_model_len} sequence needs {per_seq}"
            )
        return min(wanted, fits)

    # ---------------------------------------------------------------- public API
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for `prompts` (strings, token-id lists, or a mix); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
        for request in requests:  # reject the whole call before queueing any of it
            self.scheduler.check(request)
        for request in requests:
            self.scheduler.add(request)
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        with tqdm(total=len(requests), desc="generate", unit="req", disable=not show) as bar:
            while self.scheduler.has_work:
                bar.update(self.step())
        return [self._output(r) for r in requests]

    def step(self) -> int:
        """One step: schedule -> runner -> sample -> append. Returns how many requests finished."""
        start = time.perf_counter()
        step = self.scheduler.schedule()
        if not step.requests:
            raise RuntimeError("scheduler made no progress: no running request and none admissible")
        out = self.runner.run(step)
        for r, n in zip(step.requests, step.num_tokens):
            r.num_computed += n
        # Every row a decode, a verify group or a final prefill chunk sampled from, in one batched draw.
        scheduled = zip(step.requests, step.phases, out.rows)
        draws = [(i, j) for i, (r, phase, rows) in enumerate(scheduled) for j in self._sample_rows(r, phase, rows)]
        per_request: dict[int, list[int]] = {}
        if draws:
            picked = [step.requests[i] for i, _ in draws]
            rows = out.logits[torch.tensor([j for _, j in draws], device=out.logits.device)]
            sampled = sample(rows, [r.params for r in picked], [r.generator for r in picked]).tolist()
            for (i, _), token in zip(draws, sampled):
                per_request.setdefault(i, []).append(token)
        finished = generated = 0
        for i, (r, phase, tokens, rows) in enumerate(zip(step.requests, step.phases, step.token_ids, out.rows)):
            if phase is Phase.PREFILL and r.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(r, tokens, out.logits[rows])
            if i in per_request:
                new, done = self._accept(r, phase, tokens, per_request[i], out.logits[rows])
                generated += new
                finished += done
        self.metrics.append(
            StepMetrics(
                step=len(self.metrics),
                seconds=time.perf_counter() - start,
                scheduled_tokens=step.total_tokens,
                generated_tokens=generated,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                pages_in_use=self.scheduler.ledger.pages_in_use,
            )
        )
        return finished

    @staticmethod
    def _sample_rows(request: Request, phase: Phase, rows: slice) -> range:
        """Rows of `logits` to sample for `request`: all of a verify group, the last of a decode or final chunk."""
        if phase is Phase.VERIFY:
            return range(rows.start, rows.stop)
        if request.prefilling or rows.stop == rows.start:
            return range(0)
        return range(rows.stop - 1, rows.stop)

    def _accept(self, request: Request, phase: Phase, tokens, sampled: list[int], logits) -> tuple[int, int]:
        """Append the sampled tokens; for a verify group, the drafts that match the draws and then the first draw
        that does not (or the bonus draw after the last draft). Returns (tokens appended, whether it finished).

        Accepting a draft exactly when the draw equals it keeps every token distributed as plain sampling would.
        The cache keeps the accepted tokens only (`PagedCache.rollback`)."""
        drafts = tokens[1:] if phase is Phase.VERIFY else []
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        new = sampled[: accepted + 1]
        request.draft_token_ids = []
        appended = 0
        first = len(logits) - len(sampled)  # the sampled rows are the last ones of the request's rows
        for j, token in enumerate(new):
            if request.params.logprobs is not None:
                request.logprobs = request.logprobs or []
                request.logprobs += self._logprobs(logits[first + j : first + j + 1], [token], request.params.logprobs)
            appended += 1
            if self._append(request, token):
                return appended, 1
        if accepted < len(drafts):
            keep = request.num_computed - (len(drafts) - accepted)
            self.cache.rollback(request.request_id, keep)
            request.num_computed = keep
        return appended, 0

    def _record_prompt_logprobs(self, request: Request, tokens: list[int], logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens 1.. from the chunk's rows (row j predicts the token after chunk token j)."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        start = len(request.prompt_logprobs)  # the prompt index the chunk's first row predicts
        targets = request.prompt_ids[start : start + len(tokens)]
        entries = self._logprobs(logits[: len(targets)], targets, request.params.prompt_logprobs)
        request.prompt_logprobs.extend(entries)

    def _logprobs(self, logits: torch.Tensor, token_ids: list[int], n: int) -> list[dict[int, Logprob]]:
        decode = None if self.tokenizer is None else (lambda t: self.tokenizer.decode([t]))
        return logprobs_of(logits, token_ids, [n] * len(token_ids), decode)

    # ---------------------------------------------------------------- internals
    def _make_request(self, prompt, params: SamplingParams) -> Request:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token-id lists or LLM(..., tokenizer=...)")
            ids, text = self.tokenizer(prompt)["input_ids"], prompt
        else:
            ids, text = list(prompt), None
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {ids}")
        request = Request(self._next_id, text, ids, params, make_generator(params.seed, self.device))
        self._next_id += 1
        return request

    def _append(self, request: Request, token: int) -> bool:
        request.output_ids.append(token)
        params, eos = request.params, self.model.config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
            reason = "stop"
        elif len(request.output_ids) >= params.max_tokens:
            reason = "length"
        if params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:
                request.text, reason = text[: min(hits)], "stop"
        if reason is None:
            return False
        # Zero the state slot on release: the next sequence in it must start from an empty state.
        self.cache.reset_state(self.cache.ledger.seqs[request.request_id].slot)
        self.scheduler.finish(request, reason)
        return True

    def _output(self, r: Request) -> RequestOutput:
        text = r.text
        if not text and self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return RequestOutput(
            r.request_id, r.prompt, r.prompt_ids, r.output_ids, text, r.finish_reason, r.logprobs, r.prompt_logprobs
        )
