"""End-to-end decode speed of the engine (`LLM.step`) against the bandwidth floor and transformers' native model.

    python scripts/bench_e2e.py                      # kimi-linear-48b-a3b shapes, 27 layers, bf16, on the GPU
    python scripts/bench_e2e.py --layers 8 --quick   # a short run: batch 1 and 8 at 4k, fewer steps
    python scripts/bench_e2e.py --device cpu --preset tiny --layers 2   # CPU smoke run (tiny shapes, seconds)

Weights are random (built on the meta device, materialised on the target device with the model's own
initialisation). Each case (batch x context) builds an `LLM` and fills its cache without a prefill: every MLA page
gets random latents and every KDA state random values, and each request is registered as having its context
cached (lengths set, one sampled token pending). The timed steps are then the engine's real greedy decode steps,
`LLM.step()` (schedule -> runner, CUDA graphs on unless --eager -> sample -> append), wall clock, host included.

Per case: ms per step, tokens/s, kernels per step (torch.profiler's CUDA kernel events over profiled steps), the
bandwidth floor and the share of it reached. The floor's bytes: every weight the step reads (attention, dense MLP,
norms, router, shared experts, lm_head, the embedding rows of the batch) plus the routed experts the step actually
touched (distinct experts per layer, counted by hooks on an eager copy of the step) plus the cache (each MLA layer's
latents over the context, read, and the new token's, written) plus the KDA recurrent and conv states (read and
written); divided by the device-to-device copy bandwidth measured in the same run. transformers' native
`KimiLinearForCausalLM` (with fla where importable) runs at batch 1 and 8 at the same shapes (its own prefill, then
timed decode steps); `speedup_vs_hf` is its ms per step over ours. After each decode case, verify steps of 1 + k
tokens a sequence (--verify-k, default 4) run at the same shapes and report `verify_over_decode`, their ms per step
over the decode case's. One 32k-token prompt is also prefilled through the engine for prefill tokens/s. Every row
has a `phase` ("decode", "verify", "prefill"). Rows go to benchmarks/results/e2e.jsonl (or --out); a table ends
the run.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import inspect
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import JsonlWriter, copy_tbps, int_list, print_markdown_table, run_metadata  # noqa: E402

from kimi_helix import KimiK3ForCausalLM  # noqa: E402
from kimi_helix.engine import LLM, SamplingParams  # noqa: E402
from kimi_helix.kernels.launch import cdiv  # noqa: E402
from kimi_helix.modeling.batch import Phase  # noqa: E402
from kimi_helix.modeling.moe import RoutedExperts, TopkRouter  # noqa: E402
from kimi_helix.presets import PRESETS, get_preset  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "e2e.jsonl"
GPU_CASES = dict(batches=(1, 8, 64, 256), contexts=(4096, 32768), steps=20, prefill=32768, hf_batches=(1, 8))
QUICK_CASES = dict(batches=(1, 8), contexts=(4096,), steps=8, prefill=8192, hf_batches=(1,))
CPU_CASES = dict(batches=(1, 2), contexts=(16,), steps=2, prefill=32, hf_batches=(1,))
PROFILED_STEPS = 2
WARMUP_STEPS = 2  # the first captures the step's CUDA graph


def truncated_config(preset: str, layers: int | None):
    """The preset's config with only its first `layers` layers (all when None)."""
    config = get_preset(preset)
    if layers is None or layers == config.num_hidden_layers:
        return config
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {config.num_hidden_layers}], got {layers}")
    lac = dict(config.linear_attn_config)
    lac["kda_layers"] = [i for i in lac["kda_layers"] if i <= layers]
    lac["full_attn_layers"] = [i for i in lac["full_attn_layers"] if i <= layers]
    return type(config)(**{**config.to_dict(), "num_hidden_layers": layers, "linear_attn_config": lac})


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


def weight_bytes(model: KimiK3ForCausalLM, batch: int, experts_touched: list[int]) -> int:
    """Bytes of weights one decode step reads: every parameter once, but only `batch` embedding rows and, per MoE
    layer, only the routed experts it touched (`experts_touched`, in layer order)."""
    total, moe_layer = 0, 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            nbytes = p.numel() * p.element_size()
            if module is model.model.embed_tokens:
                nbytes = batch * p.shape[1] * p.element_size()
            elif isinstance(module, RoutedExperts):
                nbytes = nbytes // p.shape[0] * experts_touched[moe_layer]
                moe_layer += name == "down_proj"  # gate_up_proj then down_proj per layer
            total += nbytes
    return total


def cache_bytes(llm: LLM, batch: int, context: int, new_tokens: int = 1) -> int:
    """Bytes of cache and state a step of `new_tokens` tokens a sequence moves: MLA latents of the context and the
    new tokens read (the new ones also written), KDA recurrent and conv states read and written, and for a verify
    step (new_tokens > 1) the per-token recurrent states its rollback needs, written."""
    total = 0
    for pages in llm.cache.pages.values():
        total += batch * (context + 2 * new_tokens) * pages.shape[2] * pages.element_size()
    for pools in (llm.cache.recurrent, llm.cache.conv):
        for pool in pools.values():
            total += 2 * batch * pool[0].numel() * pool.element_size()
    for pool in llm.cache.recurrent.values():
        total += batch * (new_tokens - 1) * pool[0].numel() * pool.element_size()
    return total


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_kernels(fn, device: torch.device, steps: int, top: int = 0) -> tuple[float | None, list[dict]]:
    """CUDA kernel events per call of fn over `steps` profiled calls (memcpy/memset excluded), and the `top`
    kernels by GPU time per call (name, calls and microseconds per step); (None, []) off the GPU."""
    if device.type != "cuda":
        return None, []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)  # microseconds
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    table = [dict(kernel=name[:90], calls=len(t) / steps, us=round(sum(t) / steps, 1)) for name, t in ranked]
    return len(kernels) / steps, table


def experts_touched(llm: LLM, step=None) -> list[int]:
    """Distinct routed experts each MoE layer reads in one step (`step`, default `llm.step`): one eager step with
    hooks on the routers (graph replays run no hooks)."""
    counts: list[int] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: counts.append(int(out[1].unique().numel())))
        for m in llm.model.modules()
        if isinstance(m, TopkRouter)
    ]
    graphs, llm.runner.graphs = llm.runner.graphs, None
    try:
        (step or llm.step)()
    finally:
        llm.runner.graphs = graphs
        for h in hooks:
            h.remove()
    return counts


def case_engine(model, args, batch: int, max_len: int, device, tokens_per_seq: int = 1) -> LLM:
    """The engine of one case: `batch` sequences of up to `max_len` tokens, steps of `tokens_per_seq` a sequence."""
    return LLM(
        model,
        device=device,
        max_num_seqs=batch,
        max_model_len=max_len,
        num_pages=batch * cdiv(max_len, args.page_size),
        page_size=args.page_size,
        max_num_batched_tokens=max(2048, batch * tokens_per_seq),
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.eager,
    )


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


def bench_case(model, args, batch: int, context: int, steps: int, bandwidth: float, device) -> dict:
    """One decode case through the engine; returns its row (without run metadata)."""
    config = model.config
    # warm-up, timed, profiled (twice at most: graph replays, then eagerly if the profiler saw no graph kernels)
    # and the eager step that counts the experts touched
    total_steps = WARMUP_STEPS + steps + 2 * PROFILED_STEPS + 1
    llm = case_engine(model, args, batch, context + total_steps + 2, device)
    fill_cache(llm, batch, context, total_steps + 1, config.vocab_size, seed=batch)  # + the fake first token
    ms = time_steps(llm.step, device, steps)
    (kernels, top), counted = profile_kernels(llm.step, device, PROFILED_STEPS, args.top_kernels), "replayed step"
    if kernels == 0 and llm.runner.graphs is not None:  # a profiler that misses graph kernels: the same step eagerly
        graphs, llm.runner.graphs = llm.runner.graphs, None
        (kernels, top), counted = profile_kernels(llm.step, device, PROFILED_STEPS, args.top_kernels), "eager step"
        llm.runner.graphs = graphs
    # replays rewrite the last step's cache slots and advance the KDA states: harmless to the random-weight steps
    replay_ms = time_replays(llm.runner.graphs, device, steps) if llm.runner.graphs is not None else None
    touched = experts_touched(llm)
    floor_bytes = weight_bytes(llm.model, batch, touched) + cache_bytes(llm, batch, context)
    floor_ms = 1e3 * floor_bytes / (bandwidth * 1e9)  # bandwidth in GB/s
    graphs = llm.runner.graphs
    row = dict(
        case="decode",
        phase="decode",
        mode="eager" if graphs is None else "graph",
        layers=config.num_hidden_layers,
        batch=batch,
        context=context,
        ms_per_step=round(ms, 4),
        tokens_per_s=round(batch * 1e3 / ms, 1),
        replay_ms=None if replay_ms is None else round(replay_ms, 4),
        host_ms=None if replay_ms is None else round(ms - replay_ms, 4),
        kernels_per_step=kernels,
        kernels_per_layer=None if kernels is None else round(kernels / config.num_hidden_layers, 1),
        kernels_counted=None if kernels is None else counted,
        floor_ms=_sig(floor_ms),
        floor_gb=round(floor_bytes / 1e9, 3),
        pct_of_floor=_sig(100 * floor_ms / ms),
        experts_touched_mean=round(sum(touched) / max(len(touched), 1), 1),
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if top:
        row["top_kernels"] = top
        busy = sum(k["us"] for k in top)
        print(f"batch {batch}, context {context}: top {len(top)} kernels, {busy / 1e3:.3f} of {ms:.3f} ms per step")
        for k in top:
            print(f"  {k['us']:9.1f} us  {k['calls']:6.1f}x  {k['kernel']}")
    if graphs is not None and graphs.uncapturable:
        row["uncapturable"] = sorted(set(graphs.uncapturable.values()))[:1]
    del llm
    release(device)
    return row


def bench_verify(model, args, batch: int, context: int, steps: int, k: int, bandwidth: float, device) -> dict:
    """Verify steps of 1 + k tokens a sequence through `LLM.step` (verify graphs unless --eager) at a decode
    case's shapes. The drafts are random, so nearly all are rejected: each step samples every row, appends one
    token and rolls the KDA states back to it, as a speculative step whose drafts miss."""
    total = WARMUP_STEPS + steps + PROFILED_STEPS + 1  # + the eager step that counts the experts touched
    max_tokens = total * (k + 1) + 2  # room for every draft accepted
    llm = case_engine(model, args, batch, context + max_tokens + 1, device, tokens_per_seq=k + 1)
    vocab = model.config.vocab_size
    fill_cache(llm, batch, context, max_tokens, vocab, seed=batch)
    g = torch.Generator().manual_seed(batch + 1)

    def step() -> None:
        for r in llm.scheduler.running:
            r.draft_token_ids = torch.randint(0, vocab, (k,), generator=g).tolist()
        llm.step()

    ms = time_steps(step, device, steps)
    kernels, _ = profile_kernels(step, device, PROFILED_STEPS)
    touched = experts_touched(llm, step)
    floor_bytes = weight_bytes(llm.model, batch * (k + 1), touched) + cache_bytes(llm, batch, context, k + 1)
    floor_ms = 1e3 * floor_bytes / (bandwidth * 1e9)
    graphs = llm.runner.graphs
    graphed = graphs is not None and any(key.phase is Phase.VERIFY for key in graphs.graphs)
    llm = graphs = None  # the closure keeps the cell: free the engine before the next case
    release(device)
    return dict(
        case="verify",
        phase="verify",
        mode="graph" if graphed else "eager",
        layers=model.config.num_hidden_layers,
        batch=batch,
        context=context,
        draft_tokens=k,
        ms_per_step=round(ms, 4),
        verify_tokens_per_s=round(batch * (k + 1) * 1e3 / ms, 1),
        kernels_per_step=kernels,
        floor_ms=_sig(floor_ms),
        floor_gb=round(floor_bytes / 1e9, 3),
        pct_of_floor=_sig(100 * floor_ms / ms),
        experts_touched_mean=round(sum(touched) / max(len(touched), 1), 1),
        kv_cache_dtype=args.kv_cache_dtype,
    )


def bench_prefill(model, args, tokens: int, device) -> dict:
    """One prompt of `tokens` tokens prefilled through the engine (chunked by its token budget), one token out."""
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
    prompt = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([prompt[: min(tokens, args.prefill_chunk)]], params, use_tqdm=False)  # compiles the kernels
    sync(device)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    del llm
    release(device)
    return dict(
        case="prefill",
        phase="prefill",
        layers=model.config.num_hidden_layers,
        batch=1,
        context=tokens,
        ms_per_step=round(seconds * 1e3, 2),
        prefill_tokens_per_s=round(tokens / seconds, 1),
        prefill_chunk=args.prefill_chunk,
    )


def _sig(x: float) -> float:
    """x to 4 significant digits (tiny CPU shapes give floors of microseconds)."""
    return float(f"{x:.4g}")


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def guarded(phase: str, shape: dict, device, fn, *args) -> dict:
    """fn(*args)'s row, or a row saying the case ran out of memory."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError as err:
        release(device)
        return dict(case=phase, phase=phase, **shape, skipped=f"out of memory: {str(err)[:120]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 <= args.verify_k <= 8:
        raise SystemExit(f"--verify-k must be in [0, 8] (verify graphs take k <= 8), got {args.verify_k}")
    device = torch.device(args.device)
    cases = dict(CPU_CASES if device.type == "cpu" else QUICK_CASES if args.quick else GPU_CASES)
    batches, contexts = args.batches or cases["batches"], args.contexts or cases["contexts"]
    hf_contexts = [c for c in contexts if c <= HF_MAX_CONTEXT] if args.hf_contexts is None else args.hf_contexts
    steps = args.steps or cases["steps"]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    config = truncated_config(args.preset, args.layers)
    meta = {**run_metadata(), "preset": args.preset, "dtype": str(dtype).removeprefix("torch.")}
    bandwidth = copy_tbps(device, gib=1 if device.type == "cuda" else 1 / 64) * 1e3  # GB/s
    meta["copy_gbps"] = round(bandwidth, 1)
    print(f"{args.preset}, {config.num_hidden_layers} layers, {meta['dtype']}, copy bandwidth {bandwidth:.0f} GB/s")

    rows: list[dict] = []
    with JsonlWriter(args.out) as results:
        # transformers first: both models at full size do not fit on one GPU together
        hf_rows = [] if args.no_hf else bench_hf(args, dtype, device, cases["hf_batches"], hf_contexts, steps)
        for hf_row in hf_rows:
            rows.append({**meta, **hf_row})
            results.write(rows[-1])
        model = random_model(config, dtype, device)
        for context in contexts:
            for batch in batches:
                shape = dict(layers=config.num_hidden_layers, batch=batch, context=context)
                case = (model, args, batch, context, steps)
                row = guarded("decode", shape, device, bench_case, *case, bandwidth, device)
                hf = next((r for r in hf_rows if (r["batch"], r["context"]) == (batch, context)), None)
                if hf is not None and "ms_per_step" in row and "ms_per_step" in hf:
                    row["speedup_vs_hf"] = round(hf["ms_per_step"] / row["ms_per_step"], 2)
                rows.append({**meta, **row})
                results.write(rows[-1])
                if args.verify_k and "ms_per_step" in row:
                    verify = guarded("verify", shape, device, bench_verify, *case, args.verify_k, bandwidth, device)
                    if "ms_per_step" in verify:  # the time ratio, and the ratio of the bytes the two must move
                        verify["verify_over_decode"] = round(verify["ms_per_step"] / row["ms_per_step"], 3)
                        verify["floor_over_decode"] = round(verify["floor_ms"] / row["floor_ms"], 3)
                    rows.append({**meta, **verify})
                    results.write(rows[-1])
        if not args.no_prefill:
            rows.append({**meta, **bench_prefill(model, args, cases["prefill"], device)})
            results.write(rows[-1])
    print_table(rows)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="kimi-linear-48b-a3b", help="model shapes (default: kimi-linear-48b-a3b)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batches", type=int_list, default=None, help="comma-separated (default: 1,8,64,256)")
    p.add_argument("--contexts", type=int_list, default=None, help="comma-separated (default: 4096,32768)")
    p.add_argument("--hf-contexts", type=int_list, default=None,
                   help=f"contexts for transformers' model (default: those <= {HF_MAX_CONTEXT})")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per case")
    p.add_argument("--quick", action="store_true", help="a short run: batch 1 and 8 at 4k, fewer steps")
    p.add_argument("--eager", action="store_true", help="LLM(enforce_eager=True): no CUDA graphs")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' native model")
    p.add_argument("--no-prefill", action="store_true", help="skip the long-prompt prefill")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=8192, help="the engine's token budget for the prefill case")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    p.add_argument("--verify-k", type=int, default=4,
                   help="after each decode case, verify steps of 1 + K tokens a sequence (0: none)")  # fmt: skip
    p.add_argument("--top-kernels", type=int, default=0, help="print and record the N kernels of most GPU time")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSONL results (default: {DEFAULT_OUT})")
    return p.parse_args(argv)


# ---------------------------------------------------------------- transformers' native model
# Its MLA attends over expanded per-head keys; at 32k keys its prefill's memory and time leave the run's budget.
HF_MAX_CONTEXT = 4096


def hf_model(preset: str, layers: int | None, dtype: torch.dtype, device: torch.device):
    """transformers' `KimiLinearForCausalLM` at the preset's shapes (first `layers` layers), random weights."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    kw = copy.deepcopy(PRESETS[preset])
    lac = kw.pop("linear_attn_config")
    if layers is not None:
        kw["num_hidden_layers"] = layers
        lac["kda_layers"] = [i for i in lac["kda_layers"] if i <= layers]
        lac["full_attn_layers"] = [i for i in lac["full_attn_layers"] if i <= layers]
    renames = dict(num_experts="num_local_experts", num_experts_per_token="num_experts_per_tok",
                   num_shared_experts="n_shared_experts", num_expert_group="n_group")  # fmt: skip
    kw = {renames.get(k, k): v for k, v in kw.items()}
    config = hf.KimiLinearConfig(linear_attn_config=lac, **kw)
    with torch.device("meta"):
        model = hf.KimiLinearForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)  # the dtype first: fp32 storage would not fit at full size
    with torch.no_grad():
        model.apply(model._init_weights)
    return model.eval()


@torch.no_grad()
def bench_hf(args, dtype, device, batches, contexts, steps) -> list[dict]:
    """transformers' model: its own prefill of random prompts, then timed greedy decode steps with its cache."""
    model = hf_model(args.preset, args.layers, dtype, device)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    backend = "fla" if importlib.util.find_spec("fla") is not None else "torch"
    rows = []
    for context in contexts:
        for batch in batches:
            row = dict(case="decode", phase="decode", mode=f"transformers+{backend}",
                       layers=model.config.num_hidden_layers, batch=batch, context=context)  # fmt: skip
            try:
                g = torch.Generator().manual_seed(batch)
                ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)
                out = model(input_ids=ids, use_cache=True)
                cache = getattr(out, "cache", None)
                cache = out.past_key_values if cache is None else cache
                token = out.logits[:, -1:].argmax(-1)
                del out
                for i in range(WARMUP_STEPS + steps):
                    if i == WARMUP_STEPS:
                        sync(device)
                        start = time.perf_counter()
                    token = model(input_ids=token, use_cache=True, **{cache_kw: cache}).logits[:, -1:].argmax(-1)
                sync(device)
                ms = (time.perf_counter() - start) * 1e3 / steps
                row.update(ms_per_step=round(ms, 3), tokens_per_s=round(batch * 1e3 / ms, 1))
                del cache
            except torch.OutOfMemoryError as err:
                row["skipped"] = f"out of memory: {str(err)[:120]}"
            release(device)
            rows.append(row)
    del model
    release(device)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ["case", "mode", "layers", "batch", "context", "ms_per_step", "replay_ms", "tokens_per_s",
            "kernels_per_step", "floor_ms", "pct_of_floor", "speedup_vs_hf", "verify_over_decode", "floor_over_decode",
            "prefill_tokens_per_s", "skipped"]  # fmt: skip
    print_markdown_table(rows, cols)


if __name__ == "__main__":
    sys.exit(main())
