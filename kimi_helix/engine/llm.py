"""`LLM`: offline batched generation with the shape of vLLM's API, on the paged hybrid cache."""

from __future__ import annotations

import numbers
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..kernels.backends import BackendChoice
from ..kernels.launch import cdiv
from ..modeling.batch import Phase
from ..modeling.model import KimiK3ForCausalLM
from ..tokenizer import load_tokenizer
from .arguments import (
    check_arguments,
    check_async_scheduling,
    check_device,
    check_dtype,
    graph_draft_tokens,
    is_int,
)
from .async_scheduling import AsyncScheduling
from .cache import PagedCache, PageLedger
from .cuda_graph import StepGraphs
from .planner import verify_graph_tokens
from .runner import ModelRunner
from .sampling import Logprob, SamplingParams, logprobs_of, make_generator, sample
from .scheduler import Request, RequestMetrics, Scheduler

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


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
    metrics: RequestMetrics | None = None  # arrival, first token and finish times

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
    bytes_sent: int = 0  # what this rank sent to other ranks in the step (tensor / context parallelism)
    verify_groups: int = 0  # speculative verify groups the step ran (a speculative decoding round when > 0)

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class LLM:
    """Batched generation over a paged MLA latent cache and a KDA state pool.

    Args:
        model: a checkpoint directory or a loaded `KimiK3ForCausalLM`; None loads the shipped demo model
            (`kimi_helix.assets.demo_model_dir()`, docs/demo-model.md).
        dtype: None (the model's; a directory loads in its saved dtype), torch.float32 / bfloat16 / float16 or
            its name. device: None (cuda if available, else cpu), "cpu", "cuda", "cuda:N" or a torch.device.
        device_map: None, or "auto" to let `from_pretrained` place a directory's layers over the GPUs and the CPU
            (accelerate); the cache then lives on the device of the embeddings. Not with `device`.
        page_size: tokens per cache page. max_num_seqs: running sequences at most (= state slots).
        max_model_len: prompt + generated tokens per request at most, a positive int up to the config's
            `model_max_length` (default: that, capped at 8192).
        kv_cache_dtype: "auto" (model dtype) or "fp8_e4m3" (per-token scaled e4m3 latents).
        gpu_memory_utilization: share of free GPU memory the cache may take (CUDA only).
        attention_backend: None (automatic: the first backend whose declared capabilities serve each call, unless
            $KIMI_HELIX_ATTENTION_BACKEND names one), or "torch", "triton", "sdpa" to force MLA attention to one (a
            forced backend that cannot serve a call raises).
        kernel_backend: the same for KDA, the short conv, the gated norm and the MoE experts ("torch", "triton";
            $KIMI_HELIX_KERNEL_BACKEND). The choice is set on the model, so its own `generate` follows it too.
        num_pages: cache pages; default sized from free GPU memory, or for 8 full-length sequences on CPU.
        max_num_batched_tokens: token budget per step (chunked prefill); default 2048.
        tensor_parallel_size, context_parallel_size: tp and Helix cp (`kimi_helix.parallel`); with tp * cp > 1
            every rank of a torchrun launch builds the LLM (a directory is read slice by slice, a model object is
            sharded in place), every rank runs `generate` and rank 0 returns the outputs (the others get []).
        dist_timeout_s: when the LLM joins the process group itself (from torchrun's environment), how long a
            collective waits for a failed or hung rank before every rank raises `RankFailureError` naming it.
        speculative_config: None, or vLLM's spelling: `{"method": "dspark" | "ngram", "model": DRAFT_DIR,
            "num_speculative_tokens": k, ...}` (see `kimi_helix.speculative.validator`); checked before any
            weights load. `{"method": "custom", "num_speculative_tokens": k}` with `proposer=` runs your own.
            Under tp * cp > 1 every rank drafts in lockstep and keeps rank 0's drafts and verdicts; cp > 1 admits
            DSpark linear chains only.
        proposer: a `kimi_helix.speculative.proposers.Proposer` for method "custom" (docs/speculative.md).
        tokenizer: for string prompts and stop strings; default: the one saved in the model's folder (a directory,
            or the `name_or_path` a loaded model came from), loaded by `load_tokenizer`, which runs no code from it.

    A bad argument raises `ValueError` naming it and what is allowed. `generate` calls on one `LLM` from several
    threads run one after another.
        enforce_eager: run every step eagerly; by default on CUDA uniform decode and verify steps replay CUDA
            graphs (`engine.cuda_graph`), which reserve one extra state slot and cache page for padding rows.
        async_scheduling: launch each step before the previous one's tokens reach the host
            (`engine.async_scheduling`; with speculative decoding, each greedy DSpark round before the previous
            round's verdict, `speculative.async_rounds`); None (default) turns it on for one CUDA process. True
            also works on the CPU (no overlap there, the same tokens); it cannot be combined with tp * cp > 1.
            Steps and rounds that cannot overlap (logprobs, sampled or ngram rounds, ...) run synchronously.
        max_draft_tokens: drafts per verify group that CUDA-graphed verify steps take (0 to 8); None (default):
            the speculative config's `num_speculative_tokens`, else 0. With graphs on and k > 0, the KDA verify
            scratch of up to `planner.verify_graph_tokens` tokens (max_num_seqs x (1 + k), capped) is set aside
            before the cache is sized; larger verify steps, and all of them at 0, run eagerly. Set it to verify
            drafts placed on requests by hand (`Request.draft_token_ids`) in graphs without a speculative config.
    """

    def __init__(
        self,
        model=None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        page_size: int = 64,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        attention_backend: str | None = None,
        kernel_backend: str | None = None,
        num_pages: int | None = None,
        max_num_batched_tokens: int = 2048,
        tokenizer=None,
        tensor_parallel_size: int = 1,
        context_parallel_size: int = 1,
        dist_timeout_s: float = 60.0,
        speculative_config: dict | None = None,
        proposer=None,
        device_map: str | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        max_draft_tokens: int | None = None,
    ):
        backends = BackendChoice.from_env(attention=attention_backend, kernels=kernel_backend)
        if model is None:
            from ..assets import demo_model_dir

            model = demo_model_dir()
        parallel = tensor_parallel_size * context_parallel_size > 1
        check_arguments(
            model,
            device,
            device_map,
            parallel,
            gpu_memory_utilization,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            tensor_parallel_size=tensor_parallel_size,
            context_parallel_size=context_parallel_size,
            max_model_len=max_model_len,
            num_pages=num_pages,
        )
        check_async_scheduling(async_scheduling, parallel)
        dtype = check_dtype(dtype)
        spec = None
        if speculative_config is not None or proposer is not None:
            from ..speculative.engine import check_speculative_config

            spec = check_speculative_config(
                speculative_config,
                model,
                proposer,
                dtype,
                check_device(device),
                kv_cache_dtype,
                backends.attention,
                tp=tensor_parallel_size,
                cp=context_parallel_size,
            )
        spec_k = spec.num_speculative_tokens if spec is not None else None
        draft_tokens = graph_draft_tokens(max_draft_tokens, spec_k, page_size)  # before any weights load
        folder = model if isinstance(model, (str, Path)) else getattr(model, "name_or_path", None)
        self._place_model(
            model, dtype, device, device_map, (tensor_parallel_size, context_parallel_size), dist_timeout_s
        )
        self.tokenizer = tokenizer if tokenizer is not None else _folder_tokenizer(folder)
        eos = self.model.config.eos_token_id  # read once: a config attribute costs microseconds, tokens are many
        self._eos_ids = frozenset(eos if isinstance(eos, list) else [eos]) if eos is not None else frozenset()
        self.backends = backends
        self.model.model.set_backends(backends)
        self.max_model_len = self._check_max_model_len(max_model_len)
        # Verify graphs (and the memory their scratch takes) only where verify steps are configured and graphed.
        graphs = self.device.type == "cuda" and not enforce_eager and self.comm is None
        draft_tokens = draft_tokens if graphs else 0
        if num_pages is None:
            num_pages = self._default_num_pages(
                page_size, max_num_seqs, kv_cache_dtype, gpu_memory_utilization, max_num_batched_tokens, draft_tokens
            )
        self._build_engine(
            num_pages, page_size, max_num_seqs, max_num_batched_tokens, kv_cache_dtype, graphs, draft_tokens
        )
        self.metrics: list[StepMetrics] = []
        self._next_id = 0
        self.speculative = None
        if spec is not None:
            from ..speculative.engine import build_speculative_decoder

            self.speculative = build_speculative_decoder(spec, self, proposer)
        if async_scheduling is None:
            async_scheduling = self.device.type == "cuda" and self.comm is None
        self.async_scheduling = AsyncScheduling(self) if async_scheduling and self.speculative is None else None
        self.async_rounds = None
        if async_scheduling and self.speculative is not None:
            from ..speculative.async_rounds import AsyncRounds

            self.async_rounds = AsyncRounds(self)
        self._lock = threading.Lock()

    def _place_model(self, model, dtype, device, device_map, parallel_sizes: tuple[int, int], timeout_s: float):
        """Sets `self.model`, `self.device` and `self.comm`: under tp * cp > 1 (`parallel_sizes`) this rank's shard
        and its communicator, else the whole model (loaded from a directory, or moved and cast) and None."""
        self.comm = None
        if parallel_sizes[0] * parallel_sizes[1] > 1:
            from ..parallel.engine import parallel_model

            model, self.comm = parallel_model(model, *parallel_sizes, dtype=dtype, device=device, timeout_s=timeout_s)
            device = device or next(model.parameters()).device
        self.model, self.device = _load_model(model, dtype, check_device(device), device_map)

    def _check_max_model_len(self, max_model_len: int | None) -> int:
        """The request length cap: `max_model_len` (at most the config's `model_max_length`), or by default that
        capped at 8192."""
        limit = self.model.config.model_max_length
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's model_max_length={limit}")
        return max_model_len or min(limit, 8192)

    def _build_engine(
        self, num_pages, page_size, max_num_seqs, max_num_batched_tokens, kv_cache_dtype, use_graphs, draft_tokens
    ):
        """The cache, scheduler and model runner; with `use_graphs` (CUDA, one process, not eager) also the step
        graphs, whose verify steps take up to `draft_tokens` drafts a sequence within the verify scratch the
        planner prices (`verify_graph_tokens`)."""
        # CUDA graphs (one process only for now) keep one extra state slot and page for their padding rows.
        self.cache = self._build_cache(num_pages, page_size, max_num_seqs, kv_cache_dtype, extra=int(use_graphs))
        self.scheduler = Scheduler(self.cache.ledger, max_num_seqs, max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(
            self.model,
            self.cache,
            self.device,
            max_num_seqs=max_num_seqs,
            max_num_tokens=max_num_batched_tokens,
            max_pages_per_seq=cdiv(self.max_model_len, page_size),
            attention_backend=self.backends.attention,
        )
        if use_graphs:
            verify_tokens = verify_graph_tokens(max_num_seqs, max_num_batched_tokens, draft_tokens)
            self.runner.graphs = StepGraphs(self.runner, max_draft_tokens=draft_tokens, verify_tokens=verify_tokens)

    def _build_cache(self, num_pages: int, page_size: int, max_num_seqs: int, kv_cache_dtype: str, extra: int):
        """The paged cache: one process's (`extra` more pages and state slots for CUDA-graph padding rows), or
        this rank's share under tp * cp > 1 (`parallel.helix.helix_cache`)."""
        config, dtype = self.model.config, self.model.dtype
        if self.comm is None:
            ledger = PageLedger(num_pages + extra, page_size, max_num_seqs + extra)
            return PagedCache(config, ledger, dtype, self.device, kv_cache_dtype)
        from ..parallel.helix import helix_cache

        return helix_cache(
            config, self.comm, num_pages, page_size, max_num_seqs, dtype, self.device, kv_cache_dtype=kv_cache_dtype
        )

    def _default_num_pages(
        self, page_size, max_num_seqs, kv_cache_dtype, utilization, max_num_batched_tokens, draft_tokens
    ) -> int:
        """Pages for `max_num_seqs` full-length sequences at most; on CUDA also at most what fits in
        `utilization` of the free memory after the KDA state pool and, when verify steps are graphed
        (`draft_tokens` > 0), their verify scratch (weights are already resident)."""
        per_seq = cdiv(self.max_model_len, page_size)
        wanted = per_seq * max_num_seqs if self.device.type == "cuda" else per_seq * min(max_num_seqs, 8)
        if self.device.type != "cuda":
            return wanted
        from .planner import cache_bytes_per_token, kda_state_bytes_per_rank, verify_scratch_bytes_per_token

        config, itemsize = self.model.config, self.model.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(self.device)
        token_bytes = cache_bytes_per_token(config, itemsize, kv_cache_dtype)
        state_bytes = kda_state_bytes_per_rank(config, 1, itemsize) * max_num_seqs
        verify_tokens = verify_graph_tokens(max_num_seqs, max_num_batched_tokens, draft_tokens)
        verify_bytes = verify_tokens * verify_scratch_bytes_per_token(config, 1, itemsize)
        budget = int(free * utilization) - state_bytes - verify_bytes
        fits = budget // max(1, token_bytes * page_size)
        if fits < per_seq:
            raise ValueError(
                f"gpu_memory_utilization={utilization} of {free / 2**30:.1f} GiB free leaves room for {max(fits, 0)} "
                f"cache pages of {page_size} tokens (after {verify_bytes / 2**30:.1f} GiB of verify scratch for "
                f"max_draft_tokens={draft_tokens}); one max_model_len={self.max_model_len} sequence needs {per_seq}"
            )
        return min(wanted, fits)

    # ---------------------------------------------------------------- public API
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for `prompts` (strings, token-id lists, or a mix); outputs come back in prompt order.

        Calls from several threads run one after another. If the call fails or is interrupted (KeyboardInterrupt),
        the requests it queued are aborted, their pages and state slots freed, and the error propagates.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        with self._lock:
            requests = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
            for request in requests:  # reject the whole call before queueing any of it
                self.scheduler.check(request)
            for request in requests:
                self.scheduler.add(request)
            show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
            show = show and (self.comm is None or self.comm.mapping.rank == 0)
            try:
                with tqdm(total=len(requests), desc="generate", unit="req", disable=not show) as bar:
                    while self.scheduler.has_work:
                        bar.update(self.step())
                    if self.async_scheduling is not None:  # a step launched for requests that have since stopped
                        self.async_scheduling.drain()
                    if self.async_rounds is not None:
                        self.async_rounds.drain()
            except BaseException:
                self._abort(requests)
                raise
            if self.comm is not None and self.comm.mapping.rank != 0:
                return []
            return [self._output(r) for r in requests]

    def step(self) -> int:
        """One step: schedule -> runner -> sample -> append. Returns how many requests finished.

        With asynchronous scheduling the step is launched before the previous step's tokens are read, and this
        call appends the previous step's tokens (`engine.async_scheduling`); a step that must read its logits
        on the host first completes the step in flight."""
        if self.async_scheduling is not None:
            if self.async_scheduling.can_overlap():
                return self.async_scheduling.step()
            finished = self.async_scheduling.drain()
            if not self.scheduler.has_work:
                return finished
            return finished + self._step_sync()
        if self.async_rounds is not None:
            if self.async_rounds.can_overlap():
                finished = self.async_rounds.step()
                if finished is not None:
                    return finished
            finished = self.async_rounds.drain()
            if not self.scheduler.has_work:
                return finished
            return finished + self._step_sync()
        return self._step_sync()

    def _step_sync(self) -> int:
        """A step that reads its sampled tokens before returning."""
        start = time.perf_counter()
        if self.comm is not None:
            self.comm.reset_counters()
        if self.speculative is not None:
            self.speculative.propose(self.scheduler.running)
        step = self.scheduler.schedule()
        if not step.requests:
            raise RuntimeError("scheduler made no progress: no running request and none admissible")
        out = self.runner.run(step)
        verified = {}
        if self.speculative is not None:
            self.speculative.observe(step)
            verified = self.speculative.verify_groups(step, out)
        for r, n in zip(step.requests, step.num_tokens):
            r.num_computed += n
        # Every row a decode, a verify group or a final prefill chunk sampled from, in one batched draw.
        scheduled = zip(step.requests, step.phases, out.rows)
        draws = [(i, j) for i, (r, phase, rows) in enumerate(scheduled) for j in self._sample_rows(r, phase, rows)]
        per_request: dict[int, list[int]] = {}
        if draws:
            picked = [step.requests[i] for i, _ in draws]
            picked_rows = [j for _, j in draws]
            if picked_rows == list(range(out.logits.shape[0])):  # every row, in order: no gather
                rows = out.logits
            else:
                rows = out.logits[torch.tensor(picked_rows).to(out.logits.device, non_blocking=True)]
            sampled = sample(rows, [r.params for r in picked], [r.generator for r in picked])
            if self.comm is not None:  # every rank continues with rank 0's draws (unseeded RNGs differ)
                sampled = self.comm.broadcast(sampled)
            sampled = sampled.tolist()
            for (i, _), token in zip(draws, sampled):
                per_request.setdefault(i, []).append(token)
        finished = generated = 0
        cuts: list[tuple[Request, int]] = []
        for i, (r, phase, tokens, rows) in enumerate(zip(step.requests, step.phases, step.token_ids, out.rows)):
            if phase is Phase.PREFILL and r.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(r, tokens, out.logits[rows])
            if i in per_request or i in verified:
                args = (r, phase, tokens, per_request.get(i, []), out.logits[rows], verified.get(i))
                new, done = self._accept(*args, cuts=cuts)
                generated += new
                finished += done
        self._rollback(cuts)
        self._record_step(start, step, generated, len(verified))
        return finished

    def _record_step(self, start: float, step, generated: int, verify_groups: int = 0) -> None:
        """Append the `StepMetrics` of a step that began at `start` (perf_counter) and produced `generated` tokens."""
        self.metrics.append(
            StepMetrics(
                step=len(self.metrics),
                seconds=time.perf_counter() - start,
                scheduled_tokens=step.total_tokens,
                generated_tokens=generated,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                pages_in_use=self.scheduler.ledger.pages_in_use,
                bytes_sent=sum(self.comm.bytes_sent.values()) if self.comm is not None else 0,
                verify_groups=verify_groups,
            )
        )

    def _sample_rows(self, request: Request, phase: Phase, rows: slice) -> range:
        """Rows of `logits` to sample for `request`: all of a verify group (none when the speculative decoder
        verifies it), the last of a decode or final chunk."""
        if phase is Phase.VERIFY and self.speculative is not None:
            return range(0)
        if phase is Phase.VERIFY:
            return range(rows.start, rows.stop)
        if request.prefilling or rows.stop == rows.start:
            return range(0)
        return range(rows.stop - 1, rows.stop)

    def _accept(self, request: Request, phase: Phase, tokens, sampled: list[int], logits, verified=None, *, cuts):
        """Append the sampled tokens; for a verify group, the drafts that match the draws and then the first draw
        that does not (or the bonus draw after the last draft), or what the speculative decoder's `verified`
        result kept. Returns (tokens appended, whether it finished).

        Accepting a draft exactly when the draw equals it keeps every token distributed as plain sampling would.
        The cache keeps the accepted tokens only: a group that rejected a draft adds (request, tokens kept) to
        `cuts`, which `_rollback` cuts back with the step's others."""
        drafts = tokens[1:] if phase is Phase.VERIFY else []
        if verified is not None:
            sampled, accepted = verified.tokens, verified.num_accepted
        else:
            accepted = 0
            while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
                accepted += 1
        new = sampled[: accepted + 1]
        request.draft_token_ids = []
        appended = 0
        # A verify group's rows are its tokens'; otherwise the sampled rows are the last of the request's rows.
        first = 0 if phase is Phase.VERIFY else len(logits) - len(sampled)
        for j, token in enumerate(new):
            if request.params.logprobs is not None:
                request.logprobs = request.logprobs or []
                request.logprobs += self._logprobs(logits[first + j : first + j + 1], [token], request.params.logprobs)
            appended += 1
            if self._append(request, token):
                return appended, 1
        if accepted < len(drafts):
            cuts.append((request, request.num_computed - (len(drafts) - accepted)))
        return appended, 0

    def _rollback(self, cuts: list[tuple[Request, int]]) -> None:
        """Cut each request's cache (and drafter) back to its kept tokens, the cache's in one call for the step."""
        if not cuts:
            return
        self.cache.rollback_many([(r.request_id, keep) for r, keep in cuts])
        for request, keep in cuts:
            request.num_computed = keep
            if self.speculative is not None:
                self.speculative.rollback(request, keep)

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
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop={params.stop!r} needs a tokenizer: pass LLM(..., tokenizer=...)")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token-id lists or LLM(..., tokenizer=...)")
            ids, text = self.tokenizer(prompt)["input_ids"], prompt
        elif isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
            ids, text = prompt.tolist(), None
        elif isinstance(prompt, (list, tuple)):
            ids, text = list(prompt), None
        else:
            raise ValueError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        bad = [t for t in ids if not is_int(t)]
        if bad:  # a float id is a bug upstream; truncating it would silently run another prompt
            raise ValueError(f"prompt token ids must be ints, got {bad[:4]!r} in {ids[:16]!r}")
        ids = [int(t) for t in ids]
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {ids}")
        request = Request(self._next_id, text, ids, params, make_generator(params.seed, self.device))
        self._next_id += 1
        return request

    def _append(self, request: Request, token: int) -> bool:
        request.output_ids.append(token)
        return self._finish_if_done(request, len(request.output_ids))

    def _finish_if_done(self, request: Request, upto: int) -> bool:
        """Finish `request` if its first `upto` output tokens end it (EOS, a stop token or string, max_tokens);
        the tokens after them, placeholders of steps in flight, are dropped then. Returns whether it finished.
        Called as the host reads each token, so it also stamps the request's first-token and finish times."""
        token, params, metrics = request.output_ids[upto - 1], request.params, request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = time.perf_counter()
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self._eos_ids):
            reason = "stop"
        elif upto >= params.max_tokens:
            reason = "length"
        text = None
        if params.stop:  # `_make_request` made sure there is a tokenizer
            text = self.tokenizer.decode(request.output_ids[:upto], skip_special_tokens=True)
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:  # the text before the earliest stop string, '' when it matches at the very start
                text, reason = text[: min(hits)], "stop"
        if reason is None:
            return False
        del request.output_ids[upto:]
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        request.text = text or ""
        metrics.finished_time = time.perf_counter()
        # Zero the state slot on release: the next sequence in it must start from an empty state.
        self.cache.reset_state(self.cache.ledger.seqs[request.request_id].slot)
        self.scheduler.finish(request, reason)
        if self.speculative is not None:
            self.speculative.release(request)
        return True

    def _abort(self, requests: list[Request]) -> None:
        """Drop the unfinished `requests` from the scheduler, zeroing and freeing their state slots and pages."""
        if self.async_scheduling is not None:
            self.async_scheduling.discard()
        if self.async_rounds is not None:
            self.async_rounds.discard()
        for request in requests:
            if request.finish_reason is not None:
                continue
            blocks = self.cache.ledger.seqs.get(request.request_id)
            if blocks is not None:  # admitted: its slot may hold a half-written state
                self.cache.reset_state(blocks.slot)
            self.scheduler.abort(request)
            if self.speculative is not None:
                self.speculative.release(request)

    def _output(self, r: Request) -> RequestOutput:
        return RequestOutput(
            r.request_id, r.prompt, r.prompt_ids, r.output_ids, r.text, r.finish_reason, r.logprobs, r.prompt_logprobs,
            r.metrics,
        )  # fmt: skip


def _load_model(model, dtype, device: torch.device, device_map):
    """(the model in eval mode, the device its embeddings are on): a checkpoint folder loaded onto `device` (or
    placed by `device_map`), or a loaded model moved there."""
    if isinstance(model, (str, Path)):
        if device_map is not None:
            model = KimiK3ForCausalLM.from_pretrained(Path(model), dtype=dtype, device_map=device_map)
            return model.eval(), model.model.embed_tokens.weight.device
        return KimiK3ForCausalLM.from_pretrained(Path(model), dtype=dtype, device=device).eval(), device
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval(), device


def _folder_tokenizer(folder: str | Path | None):
    """The tokenizer saved in the model's checkpoint folder, or None when there is none (or no folder)."""
    if not folder or not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return load_tokenizer(folder)
