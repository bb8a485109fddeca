"""End-to-end decode speed of the engine (`LLM.step`) against the bandwidth floor and transformers' native model.

    python scripts/bench_e2e.py                      # kimi-linear-48b-a3b shapes, 27 layers, bf16, the whole grid
    python scripts/bench_e2e.py --budget-s 230       # the grid, most important cases first, within 230 s
    python scripts/bench_e2e.py --layers 8 --quick   # a short run: batch 1 and 8 at 4k, fewer steps
    python scripts/bench_e2e.py --device cpu --preset tiny --layers 2   # CPU smoke run (tiny shapes, seconds)

Weights are random (built on the meta device, materialised on the target device with the model's own
initialisation). Each case builds an `LLM` and fills its cache without a prefill: every MLA page gets random
latents and every KDA state random values, and each request is registered as having its context cached (lengths
set, one sampled token pending). The timed steps are then the engine's real greedy steps, `LLM.step()` (schedule
-> runner, CUDA graphs on unless --eager -> sample -> append), wall clock, host included.

The grid (`plan_cases`), in order of importance so that a time budget cuts the least important: per context
(4k, then 32k) decode at batch 1, 64, 8, then 256, each decode at batch 1, 8 and 64 followed by verify steps of
1 + k tokens a sequence (--verify-k, default 4; the engine is built with `max_draft_tokens=k`, so those steps
replay verify graphs up to `planner.VERIFY_GRAPH_MAX_TOKENS` tokens); then one 32k-token prompt prefilled. Before
them transformers' native `KimiLinearForCausalLM` (`bench_e2e_hf.py`) runs at batch 1 and 8 at the same shapes
(4k), then is freed: both models at full size do not fit one GPU. `speedup_vs_hf` is its ms per step over ours.

- `--budget-s`: a case starts only while the time left covers the longest case of its phase so far; otherwise
  it gets a `skipped` row saying so. A case whose cache (pages, KDA states, verify scratch, all sized by the
  planner's functions) does not fit the free memory gets a `skipped` row too; one that raises gets a `failed` row
  with the exception's text, and the run goes on.
- Per case: ms per step and tokens/s, kernels per step (torch.profiler's CUDA kernel events), the bandwidth floor
  and the share of it reached, `case_s` (its whole time: build, fill, capture, timing). The floor's bytes: every
  weight the step reads, with only the routed experts it touched (counted by hooks on an eager copy of the step)
  and only the batch's embedding rows, plus the cache and state bytes (`bench_e2e_hf.step_cache_bytes`); divided
  by the device-to-device copy bandwidth measured in the same run.

Every row has `phase` ("decode", "verify", "prefill") and at least layers, batch, context, ms_per_step,
kernels_per_step, floor_ms, pct_of_floor (None where not measured), gpu, date and commit. Rows go to
benchmarks/results/e2e.jsonl (or --out) as each case ends; a table ends the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import (  # noqa: E402
    JsonlWriter,
    copy_tbps,
    int_list,
    print_markdown_table,
    profile_kernels,
    release,
    run_metadata,
    sync,
)
from bench_e2e_hf import bench_hf, sig, step_cache_bytes, truncated_config, weight_bytes  # noqa: E402
from bench_e2e_hf import experts_touched as hooked_experts  # noqa: E402

from kimi_helix import KimiK3ForCausalLM  # noqa: E402
from kimi_helix.engine import LLM, SamplingParams  # noqa: E402
from kimi_helix.engine.planner import (  # noqa: E402
    cache_bytes_per_token,
    kda_state_bytes_per_rank,
    verify_graph_tokens,
    verify_scratch_bytes_per_token,
)
from kimi_helix.kernels.launch import cdiv  # noqa: E402
from kimi_helix.modeling.batch import Phase  # noqa: E402
from kimi_helix.modeling.moe import RoutedExperts, TopkRouter  # noqa: E402

__all__ = ["fill_cache", "random_model", "release", "sync", "truncated_config"]  # also bench_helix's

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "e2e.jsonl"
GPU_CASES = dict(batches=(1, 64, 8, 256), contexts=(4096, 32768), verify_batches=(1, 8, 64), steps=20, prefill=32768,
                 hf_batches=(1, 8))  # fmt: skip
QUICK_CASES = dict(batches=(1, 8), contexts=(4096,), verify_batches=(1,), steps=8, prefill=8192, hf_batches=(1,))
CPU_CASES = dict(batches=(1, 2), contexts=(16,), verify_batches=(1, 2), steps=2, prefill=32, hf_batches=(1,))
PROFILED_STEPS = 2
WARMUP_STEPS = 2  # the first captures the step's CUDA graph
# Memory a case needs beyond its cache: activations of a step, graph pools, the sampler, the allocator's slack.
CASE_RESERVE_BYTES = 6 << 30
# Every row has these keys (None where a case did not measure them), as issue 23 asks.
ROW_KEYS = ("layers", "batch", "context", "ms_per_step", "kernels_per_step", "floor_ms", "pct_of_floor")


@dataclass(frozen=True)
class Case:
    """One cell of the grid: phase "decode", "verify" or "prefill"; `batch` sequences at `context` tokens."""

    phase: str
    batch: int
    context: int


def plan_cases(batches, contexts, verify_batches, prefill: int | None) -> list[Case]:
    """The grid in the order it runs: per context, the decode cases in `batches` order, each decode at a batch of
    `verify_batches` followed by its verify case; then the prefill of one `prefill`-token prompt (None: none)."""
    cases = []
    for context in contexts:
        for batch in batches:
            cases.append(Case("decode", batch, context))
            if batch in verify_batches:
                cases.append(Case("verify", batch, context))
    if prefill:
        cases.append(Case("prefill", 1, prefill))
    return cases


class Budget:
    """Wall-clock budget of a run: a case of a phase starts only while the time left covers the longest case of
    that phase so far (any time left, before the first). `total_s` None never skips."""

    def __init__(self, total_s: float | None, clock=time.monotonic):
        self.total_s, self.clock, self.start = total_s, clock, clock()
        self.longest: dict[str, float] = {}

    def record(self, phase: str, seconds: float) -> None:
        self.longest[phase] = max(self.longest.get(phase, 0.0), seconds)

    def skip_reason(self, phase: str) -> str | None:
        if self.total_s is None:
            return None
        spent = self.clock() - self.start
        need = self.longest.get(phase, 0.0)
        if spent + need < self.total_s:
            return None
        return f"time budget: {spent:.0f} of {self.total_s:g} s spent, a {phase} case took up to {need:.0f} s"


def base_row(case: Case, layers: int) -> dict:
    row = dict(case=case.phase, phase=case.phase, **dict.fromkeys(ROW_KEYS))
    return row | dict(layers=layers, batch=case.batch, context=case.context)


# ---------------------------------------------------------------- the engine's model and cache
@torch.no_grad()
def random_model(config, dtype: torch.dtype, device: torch.device) -> KimiK3ForCausalLM:
    """The model built on the meta device, then given storage on `device` and the model's own random init."""
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    keep_fp32 = KimiK3ForCausalLM._keep_in_fp32_modules_strict  # the dtypes a checkpoint load gives them
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            want = torch.float32 if any(k in full for k in keep_fp32) else dtype
            module._parameters[name] = torch.nn.Parameter(
                torch.empty(param.shape, dtype=want, device=device), requires_grad=False
            )
    model.apply(model._init_weights)
    return model.eval()


def fill_cache(llm: LLM, batch: int, context: int, max_tokens: int, vocab: int, seed: int) -> None:
    """Register `batch` requests as if their `context`-token prompts were prefilled and one token sampled: random
    latents in every page, random KDA states, lengths set, the requests running (each may produce `max_tokens`,
    the fake first one included). The decode steps that follow are the engine's own."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for pages in llm.cache.pages.values():
        if pages.dtype == torch.float8_e4m3fn:  # no random kernel for fp8: draw in bf16, one layer at a time
            pages.copy_(torch.randn(pages.shape, dtype=torch.bfloat16, device=pages.device))
        else:
            pages.normal_(0, 1)
    for pool in (*llm.cache.recurrent.values(), *llm.cache.conv.values()):
        pool.normal_(0, 0.1)
    if llm.cache.fp8:
        for scales in llm.cache.scales.values():
            scales.fill_(1.0 / 64)
    for _ in range(batch):
        request = llm._make_request(torch.randint(0, vocab, (context,), generator=g).tolist(), params)
        llm.scheduler.ledger.admit(request.request_id, request.reserve_tokens)
        llm.scheduler.ledger.seqs[request.request_id].length = context
        request.num_computed = context
        request.output_ids.append(int(torch.randint(0, vocab, (1,), generator=g)))
        llm.scheduler.running.append(request)


def case_engine(model, args, batch: int, max_len: int, device, draft_tokens: int = 0) -> LLM:
    """The engine of one case: `batch` sequences of up to `max_len` tokens; `draft_tokens` > 0 for verify steps
    of 1 + draft_tokens tokens a sequence, which then replay verify graphs (`LLM(max_draft_tokens=)`)."""
    return LLM(
        model,
        device=device,
        max_num_seqs=batch,
        max_model_len=max_len,
        num_pages=batch * cdiv(max_len, args.page_size),
        page_size=args.page_size,
        max_num_batched_tokens=max(2048, batch * (1 + draft_tokens)),
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.eager,
        max_draft_tokens=draft_tokens,
    )


def fit_reason(config, args, batch: int, max_len: int, draft_tokens: int, itemsize: int, device) -> str | None:
    """Why a case's cache cannot fit the free GPU memory (its pages, KDA states of `batch` + 1 slots and verify
    scratch, sized as the engine sizes them, plus `CASE_RESERVE_BYTES`), or None when it fits or off the GPU."""
    if device.type != "cuda":
        return None
    pages = (batch * cdiv(max_len, args.page_size) + 1) * args.page_size
    need = pages * cache_bytes_per_token(config, itemsize, args.kv_cache_dtype)
    need += (batch + 1) * kda_state_bytes_per_rank(config, 1, itemsize)
    if not args.eager:
        tokens = verify_graph_tokens(batch, max(2048, batch * (1 + draft_tokens)), draft_tokens)
        need += tokens * verify_scratch_bytes_per_token(config, 1, itemsize)
    free = torch.cuda.mem_get_info(device)[0]
    if need + CASE_RESERVE_BYTES <= free:
        return None
    return (f"does not fit: cache, states and verify scratch {need / 2**30:.1f} GiB "
            f"(+{CASE_RESERVE_BYTES / 2**30:g} GiB reserve), {free / 2**30:.1f} GiB free")  # fmt: skip


def engine_experts_touched(llm: LLM, step) -> list[int]:
    """Distinct routed experts each MoE layer reads in one call of `step`, run eagerly (replays run no hooks)."""
    graphs, llm.runner.graphs = llm.runner.graphs, None
    try:
        return hooked_experts(llm.model, TopkRouter, lambda out: out[1], step)
    finally:
        llm.runner.graphs = graphs


def step_floor(llm: LLM, batch: int, context: int, new_tokens: int, touched: list[int], bandwidth: float):
    """(floor ms, floor bytes) of a step of `new_tokens` tokens a sequence; `bandwidth` in GB/s."""
    model = llm.model
    nbytes = weight_bytes(model, model.model.embed_tokens, (RoutedExperts,), batch * new_tokens, touched)
    kv_cache_dtype = "fp8_e4m3" if llm.cache.fp8 else "auto"
    nbytes += step_cache_bytes(model.config, batch, context, new_tokens, model.dtype.itemsize, kv_cache_dtype)
    return 1e3 * nbytes / (bandwidth * 1e9), nbytes


def time_steps(step, device: torch.device, steps: int) -> float:
    """ms per call of `step` over `steps` timed calls after WARMUP_STEPS untimed ones (which capture graphs)."""
    for _ in range(WARMUP_STEPS):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / steps


def time_replays(graphs, device: torch.device, steps: int) -> float | None:
    """ms per replay of the one captured decode graph alone: the GPU's share of a step, without the host's
    scheduling, staging and sampling around it (None without exactly one decode graph)."""
    decode = [c.graph for key, c in graphs.graphs.items() if key.phase is Phase.DECODE and c.graph is not None]
    if len(decode) != 1:
        return None
    decode[0].replay()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        decode[0].replay()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / steps


# ---------------------------------------------------------------- the cases
def bench_decode(model, args, case: Case, steps: int, bandwidth: float, device) -> dict:
    """One decode case through the engine: the measured fields of its row."""
    batch, context = case.batch, case.context
    # warm-up, timed, profiled (twice at most: graph replays, then eagerly if the profiler saw no graph kernels)
    # and the eager step that counts the experts touched
    total_steps = WARMUP_STEPS + steps + 2 * PROFILED_STEPS + 1
    llm = case_engine(model, args, batch, context + total_steps + 2, device)
    fill_cache(llm, batch, context, total_steps + 1, model.config.vocab_size, seed=batch)  # + the fake first token
    ms = time_steps(llm.step, device, steps)
    (kernels, top), counted = profile_kernels(llm.step, device, PROFILED_STEPS, args.top_kernels), "replayed step"
    graphs = llm.runner.graphs
    if kernels == 0 and graphs is not None:  # a profiler that misses graph kernels: the same step eagerly
        llm.runner.graphs = None
        (kernels, top), counted = profile_kernels(llm.step, device, PROFILED_STEPS, args.top_kernels), "eager step"
        llm.runner.graphs = graphs
    # replays rewrite the last step's cache slots and advance the KDA states: harmless to the random-weight steps
    replay_ms = time_replays(graphs, device, steps) if graphs is not None else None
    touched = engine_experts_touched(llm, llm.step)
    floor_ms, floor_bytes = step_floor(llm, batch, context, 1, touched, bandwidth)
    layers = model.config.num_hidden_layers
    row = dict(
        mode="eager" if graphs is None else "graph",
        ms_per_step=round(ms, 4),
        tokens_per_s=round(batch * 1e3 / ms, 1),
        replay_ms=None if replay_ms is None else round(replay_ms, 4),
        host_ms=None if replay_ms is None else round(ms - replay_ms, 4),
        kernels_per_step=kernels,
        kernels_per_layer=None if kernels is None else round(kernels / layers, 1),
        kernels_counted=None if kernels is None else counted,
        floor_ms=sig(floor_ms),
        floor_gb=round(floor_bytes / 1e9, 3),
        pct_of_floor=sig(100 * floor_ms / ms),
        experts_touched_mean=round(sum(touched) / max(len(touched), 1), 1),
        kv_cache_dtype=args.kv_cache_dtype,
    )
    row |= top_kernels_fields(top, case, ms)
    if graphs is not None and graphs.uncapturable:
        row["uncapturable"] = sorted(set(graphs.uncapturable.values()))[:1]
    return row


def bench_verify(model, args, case: Case, steps: int, bandwidth: float, device) -> dict:
    """Verify steps of 1 + k tokens a sequence (k = --verify-k) through `LLM.step` at a decode case's shapes,
    replaying verify graphs unless --eager (the engine is built with `max_draft_tokens=k`). The drafts are random,
    so nearly all are rejected: each step samples every row, appends one token and rolls the KDA states back to
    it, as a speculative step whose drafts miss. Returns the measured fields of its row."""
    k, batch, context = args.verify_k, case.batch, case.context
    total = WARMUP_STEPS + steps + PROFILED_STEPS + 1  # + the eager step that counts the experts touched
    max_tokens = total * (k + 1) + 2  # room for every draft accepted
    llm = case_engine(model, args, batch, context + max_tokens + 1, device, draft_tokens=k)
    vocab = model.config.vocab_size
    fill_cache(llm, batch, context, max_tokens, vocab, seed=batch)
    g = torch.Generator().manual_seed(batch + 1)

    def step() -> None:
        for r in llm.scheduler.running:
            r.draft_token_ids = torch.randint(0, vocab, (k,), generator=g).tolist()
        llm.step()

    ms = time_steps(step, device, steps)
    kernels, top = profile_kernels(step, device, PROFILED_STEPS, args.top_kernels)
    touched = engine_experts_touched(llm, step)
    floor_ms, floor_bytes = step_floor(llm, batch, context, k + 1, touched, bandwidth)
    graphs = llm.runner.graphs
    graphed = graphs is not None and any(key.phase is Phase.VERIFY for key in graphs.graphs)
    return dict(
        mode="graph" if graphed else "eager",
        draft_tokens=k,
        ms_per_step=round(ms, 4),
        verify_tokens_per_s=round(batch * (k + 1) * 1e3 / ms, 1),
        kernels_per_step=kernels,
        floor_ms=sig(floor_ms),
        floor_gb=round(floor_bytes / 1e9, 3),
        pct_of_floor=sig(100 * floor_ms / ms),
        experts_touched_mean=round(sum(touched) / max(len(touched), 1), 1),
        kv_cache_dtype=args.kv_cache_dtype,
    ) | top_kernels_fields(top, case, ms)


def top_kernels_fields(top: list[dict], case: Case, ms: float) -> dict:
    """Print the profiled step's kernels of most GPU time (--top-kernels) and return them as the row's field."""
    if not top:
        return {}
    busy = sum(k["us"] for k in top)
    print(
        f"{case.phase}, batch {case.batch}, context {case.context}: top {len(top)} kernels, {busy / 1e3:.3f} of "
        f"{ms:.3f} ms per step"
    )
    for k in top:
        print(f"  {k['us']:9.1f} us  {k['calls']:6.1f}x  {k['kernel']}")
    return {"top_kernels": top}


def bench_prefill(model, args, case: Case, steps: int, bandwidth: float, device) -> dict:
    """One prompt of `case.context` tokens prefilled through the engine (chunked by --prefill-chunk), one token
    out. Its floor is not a bandwidth floor (the step is compute-bound), so floor_ms stays None."""
    tokens = case.context
    llm = LLM(
        model,
        device=device,
        max_num_seqs=1,
        max_model_len=tokens + 2,
        num_pages=cdiv(tokens + 2, args.page_size),
        page_size=args.page_size,
        max_num_batched_tokens=args.prefill_chunk,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.eager,
    )
    gen = torch.Generator().manual_seed(0)
    warmup, prompt = torch.randint(0, model.config.vocab_size, (2, tokens), generator=gen).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    # A whole prompt, not its first chunk: the later chunks (a cached prefix, carried recurrent states) compile
    # kernels of their own, which the timed run would otherwise include.
    llm.generate([warmup], params, use_tqdm=False)
    sync(device)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    return dict(
        ms_per_step=round(seconds * 1e3, 2),
        prefill_tokens_per_s=round(tokens / seconds, 1),
        prefill_chunk=args.prefill_chunk,
    )


BENCH = {"decode": bench_decode, "verify": bench_verify, "prefill": bench_prefill}


def run_case(model, args, case: Case, steps: int, bandwidth: float, budget: Budget, device) -> dict:
    """`case`'s row: measured, or `skipped` (time budget, memory) or `failed` (the exception's text)."""
    row = base_row(case, model.config.num_hidden_layers)
    why = budget.skip_reason(case.phase)
    if why is None and case.phase != "prefill":
        draft_tokens = args.verify_k if case.phase == "verify" else 0
        max_len = case.context + (steps + 8) * (1 + draft_tokens)  # the context and every step's tokens
        why = fit_reason(model.config, args, case.batch, max_len, draft_tokens, model.dtype.itemsize, device)
    if why is not None:
        return row | dict(skipped=why)
    start = time.perf_counter()
    try:
        row |= BENCH[case.phase](model, args, case, steps, bandwidth, device)
    except Exception as err:  # noqa: BLE001 - out of memory, a kernel that fails at this shape: a row, not the end
        row["failed"] = f"{type(err).__name__}: {str(err)[:300]}"
    release(device)
    row["case_s"] = round(time.perf_counter() - start, 2)
    budget.record(case.phase, row["case_s"])
    return row


def with_ratios(row: dict, case: Case, decoded: dict, hf_rows: list[dict]) -> dict:
    """`row` with `speedup_vs_hf` (a decode case that transformers ran too) or `verify_over_decode` and
    `floor_over_decode` (a verify case after its decode case): ms per step and floor bytes, over each other."""
    if row.get("ms_per_step") is None:
        return row
    if case.phase == "decode":
        hf = next((r for r in hf_rows if (r["batch"], r["context"]) == (case.batch, case.context)), None)
        if hf is not None and hf.get("ms_per_step") is not None:
            row["speedup_vs_hf"] = round(hf["ms_per_step"] / row["ms_per_step"], 2)
    decode = decoded.get((case.batch, case.context))
    if case.phase == "verify" and decode is not None and decode.get("ms_per_step") is not None:
        row["verify_over_decode"] = round(row["ms_per_step"] / decode["ms_per_step"], 3)
        row["floor_over_decode"] = round(row["floor_ms"] / decode["floor_ms"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 <= args.verify_k <= 8:
        raise SystemExit(f"--verify-k must be in [0, 8] (verify graphs take k <= 8), got {args.verify_k}")
    budget = Budget(args.budget_s)
    device = torch.device(args.device)
    grid = dict(CPU_CASES if device.type == "cpu" else QUICK_CASES if args.quick else GPU_CASES)
    contexts = args.contexts or grid["contexts"]
    verify_batches = (args.verify_batches or grid["verify_batches"]) if args.verify_k else ()
    prefill = None if args.no_prefill else grid["prefill"]
    cases = plan_cases(args.batches or grid["batches"], contexts, verify_batches, prefill)
    steps = args.steps or grid["steps"]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    config = truncated_config(args.preset, args.layers)
    meta = {**run_metadata(), "preset": args.preset, "dtype": str(dtype).removeprefix("torch.")}
    bandwidth = copy_tbps(device, gib=1 if device.type == "cuda" else 1 / 64) * 1e3  # GB/s
    meta["copy_gbps"] = round(bandwidth, 1)
    print(f"{args.preset}, {config.num_hidden_layers} layers, {meta['dtype']}, copy bandwidth {bandwidth:.0f} GB/s")

    hf_rows: list[dict] = []
    with JsonlWriter(args.out) as results:
        if not args.no_hf:  # first: both models at full size do not fit on one GPU together
            hf_contexts = args.hf_contexts or [c for c in contexts if c <= HF_MAX_CONTEXT]
            shapes = [(b, c) for c in hf_contexts for b in grid["hf_batches"]]
            for row in bench_hf(args.preset, args.layers, dtype, device, shapes, args.hf_steps, bandwidth, budget):
                hf_rows.append(row)
                results.write({**meta, **row})
        start = time.perf_counter()
        model = random_model(config, dtype, device)
        sync(device)
        build_s = round(time.perf_counter() - start, 2)
        decoded: dict[tuple[int, int], dict] = {}
        for i, case in enumerate(cases):
            row = run_case(model, args, case, steps, bandwidth, budget, device)
            row = with_ratios(row, case, decoded, hf_rows) | ({"build_s": build_s} if i == 0 else {})
            if case.phase == "decode":
                decoded[case.batch, case.context] = row
            results.write({**meta, **row})
    print_table(results.records)
    return 0


# transformers' MLA attends over per-head keys expanded from the whole cache every step: at 32k its steps leave
# the run's budget, so by default it runs at the contexts up to this one.
HF_MAX_CONTEXT = 4096


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="kimi-linear-48b-a3b", help="model shapes (default: kimi-linear-48b-a3b)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batches", type=int_list, default=None, help="comma-separated, in run order (default: 1,64,8,256)")
    p.add_argument("--contexts", type=int_list, default=None, help="comma-separated (default: 4096,32768)")
    p.add_argument("--verify-batches", type=int_list, default=None, help="batches with a verify case (default: 1,8,64)")
    p.add_argument("--hf-contexts", type=int_list, default=None,
                   help=f"contexts for transformers' model (default: those <= {HF_MAX_CONTEXT})")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per case")
    p.add_argument("--hf-steps", type=int, default=5, help="timed decode steps per transformers case")
    p.add_argument("--budget-s", type=float, default=None, help="skip the cases the time left cannot cover")
    p.add_argument("--quick", action="store_true", help="a short run: batch 1 and 8 at 4k, fewer steps")
    p.add_argument("--eager", action="store_true", help="LLM(enforce_eager=True): no CUDA graphs")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' native model")
    p.add_argument("--no-prefill", action="store_true", help="skip the long-prompt prefill")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=8192, help="the engine's token budget for the prefill case")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    p.add_argument("--verify-k", type=int, default=4, help="drafts per verify step (0: no verify cases)")
    p.add_argument("--top-kernels", type=int, default=0, help="print and record the N kernels of most GPU time")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSONL results (default: {DEFAULT_OUT})")
    return p.parse_args(argv)


def print_table(rows: list[dict]) -> None:
    cols = ["case", "mode", "layers", "batch", "context", "ms_per_step", "replay_ms", "tokens_per_s",
            "kernels_per_step", "floor_ms", "pct_of_floor", "speedup_vs_hf", "verify_over_decode", "floor_over_decode",
            "prefill_tokens_per_s", "case_s", "skipped", "failed"]  # fmt: skip
    print_markdown_table(rows, cols)


if __name__ == "__main__":
    sys.exit(main())
