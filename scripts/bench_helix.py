"""Helix context parallelism: decode and verify step time of the engine against cp = 1 at long context.

    torchrun --standalone --nproc-per-node 4 scripts/bench_helix.py     # (tp, cp) = (4, 1), (2, 2), (1, 4)
    torchrun --standalone --nproc-per-node 2 scripts/bench_helix.py     # (2, 1), (1, 2)
    python scripts/bench_helix.py --cp 1                                # the one-GPU baseline, (1, 1)
    python scripts/bench_helix.py --smoke                               # CPU smoke run (tiny preset, seconds)

Weights are random, at the kimi-linear-48b-a3b shapes truncated to --layers (8). Each case (layout x context x
batch) builds `LLM(model, tensor_parallel_size=tp, context_parallel_size=cp)` on every rank and fills its cache
without a prefill, as scripts/bench_e2e.py does (random latents in each rank's own pages, random KDA states,
lengths set). The timed steps are the engine's own `LLM.step()`: first plain greedy decode steps, then verify steps
of the last token plus --k random drafts per request (the engine's verify phase, rollback of rejected drafts
included; eager, as the rollback needs the KDA states a replayed graph does not keep). ms_per_step is the slowest
rank's wall clock per step.

a2a_ms times the Helix all-to-all on its own: the same exchange (`Communicator.all_to_all_cp` of the packed
[cp, T, H / (tp cp), kv_lora_rank + 1] fp32 partials and LSEs, once per MLA layer) as one step makes, between
barriers, so its share of the step can be read off. bytes_per_rank is what rank 0 sent in the last timed step
(the communicator's counters), beside `bytes_formula`, docs/helix.md's formula (`parallel.helix.step_bytes`).
speedup_vs_cp1 is the one-GPU (tp = cp = 1) ms at the same context, batch and phase, from this run or an earlier
row in the results file on the same GPU, over this case's. Cases whose cache would not fit in the free memory of a
GPU are written as rows with a `skipped` reason. Rows go to benchmarks/results/helix.jsonl (or --out) from rank 0;
a table ends the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import JsonlWriter, int_list, print_markdown_table, run_metadata  # noqa: E402
from bench_e2e import fill_cache, random_model, release, sync, truncated_config  # noqa: E402

from kimi_helix.engine import LLM  # noqa: E402
from kimi_helix.engine.planner import cache_bytes_per_token, kda_state_bytes_per_rank  # noqa: E402
from kimi_helix.modeling.config import FULL_ATTENTION  # noqa: E402
from kimi_helix.parallel.distributed import init_distributed  # noqa: E402
from kimi_helix.parallel.helix import step_bytes  # noqa: E402
from kimi_helix.parallel.ownership import Ownership  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "helix.jsonl"
GPU_CASES = dict(contexts=(32768, 131072, 524288), batches=(1, 8), steps=10, warmup=2, page_size=64)
SMOKE_CASES = dict(contexts=(16, 40), batches=(1, 2), steps=2, warmup=1, page_size=4)
PHASES = ("decode", "verify")
ACTIVATION_RESERVE = 4 << 30  # bytes of GPU memory kept free for the step's activations and graphs


def layouts(world: int, cp: int | None = None) -> list[tuple[int, int]]:
    """(tp, cp) with tp * cp = world and cp in {1, 2, 4} (or only `cp`), cp = 1 first: the baselines."""
    return [(world // c, c) for c in (1, 2, 4) if world % c == 0 and (cp is None or c == cp)]


def cache_need(config, tp: int, cp: int, batch: int, max_len: int, page_size: int, itemsize: int) -> int:
    """Bytes of MLA pages (cp rank 0's share, the largest) and KDA states one rank allocates for the case."""
    pages = batch * Ownership(page_size, cp, 0).local_pages(max_len)
    state = batch * kda_state_bytes_per_rank(config, tp * cp, itemsize)
    return pages * page_size * cache_bytes_per_token(config, itemsize) + state


def skip_reason(need: int, free: int) -> str | None:
    """Why a case whose cache needs `need` bytes per rank cannot run with `free` bytes free, or None if it fits."""
    if need + ACTIVATION_RESERVE <= free:
        return None
    reserve = ACTIVATION_RESERVE / 2**30
    return f"cache needs {need / 2**30:.1f} GiB per rank (+{reserve:g} GiB reserve), {free / 2**30:.1f} GiB free"


def time_all_to_all(llm: LLM, tokens: int, reps: int) -> float:
    """ms per step of the Helix all-to-all alone: one exchange of the step's packed partials per MLA layer."""
    comm, config = llm.comm, llm.model.config
    if comm is None or comm.mapping.cp == 1:
        return 0.0
    cp, heads = comm.mapping.cp, config.num_attention_heads // comm.mapping.tp
    packed = torch.randn(cp, tokens, heads // cp, config.kv_lora_rank + 1, device=llm.device)
    layers = config.layer_types.count(FULL_ATTENTION)
    comm.all_to_all_cp(packed)  # warm-up (connections, NCCL channels)
    comm.barrier()
    sync(llm.device)
    start = time.perf_counter()
    for _ in range(reps * layers):
        comm.all_to_all_cp(packed)
    sync(llm.device)
    ms = (time.perf_counter() - start) * 1e3 / reps
    comm.reset_counters()
    return ms


def slowest(value: float, device: torch.device) -> float:
    """The largest `value` over all ranks (the step is as slow as its slowest rank)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed_steps(llm: LLM, steps: int, drafts: int, vocab: int, gen: torch.Generator) -> float:
    """Wall-clock ms per `LLM.step()`; with `drafts` > 0 every running request verifies that many random drafts
    (the same on every rank: `gen` is seeded alike)."""
    if llm.comm is not None:
        llm.comm.barrier()
    sync(llm.device)
    start = time.perf_counter()
    for _ in range(steps):
        for request in llm.scheduler.running:
            request.draft_token_ids = torch.randint(0, vocab, (drafts,), generator=gen).tolist() if drafts else []
        llm.step()
    sync(llm.device)
    return (time.perf_counter() - start) * 1e3 / steps


def bench_case(model, args, tp: int, cp: int, context: int, batch: int, device) -> list[dict]:
    """Decode then verify steps of one (layout, context, batch) on one LLM; a row per phase."""
    config = model.config
    per_phase = args.warmup + args.steps
    max_tokens = 2 + per_phase * (2 + args.k)  # the fake first token, decode steps, verify steps accepting all
    max_len = context + max_tokens + 1
    base = dict(tp=tp, cp=cp, context=context, batch=batch, layers=config.num_hidden_layers, k=args.k)
    need = cache_need(config, tp, cp, batch, max_len, args.page_size, model.dtype.itemsize)
    if device.type == "cuda":
        why = skip_reason(need, -slowest(-torch.cuda.mem_get_info(device)[0], device))  # the tightest rank's
        if why is not None:
            return [dict(base, phase=p, skipped=why) for p in PHASES]
    llm = LLM(
        model,
        device=device,
        max_num_seqs=batch,
        max_model_len=max_len,
        num_pages=batch * Ownership(args.page_size, cp, 0).local_pages(max_len),
        page_size=args.page_size,
        max_num_batched_tokens=max(2048, batch * (1 + args.k)),
        tensor_parallel_size=tp,
        context_parallel_size=cp,
        enforce_eager=args.eager,
    )
    fill_cache(llm, batch, context, max_tokens - 1, config.vocab_size, seed=batch)
    rank = llm.comm.mapping.rank if llm.comm is not None else 0
    rows = []
    graphs = llm.runner.graphs
    for phase, drafts in zip(PHASES, (0, args.k)):
        # A replayed verify graph keeps no per-token KDA states, which the rollback of rejected drafts needs.
        llm.runner.graphs = graphs if phase == "decode" else None
        gen = torch.Generator().manual_seed(context + batch)
        timed_steps(llm, args.warmup, drafts, config.vocab_size, gen)
        ms = slowest(timed_steps(llm, args.steps, drafts, config.vocab_size, gen), device)
        tokens = batch * (1 + drafts)
        sent = dict(llm.comm.bytes_sent) if llm.comm is not None else {}
        formula = step_bytes(config, tp, cp, tokens, tokens, tokens, model.dtype.itemsize, rank)
        a2a_ms = slowest(time_all_to_all(llm, tokens, args.steps), device)
        rows.append(
            dict(
                base,
                phase=phase,
                mode="eager" if llm.runner.graphs is None else "graph",
                ms_per_step=_sig(ms),
                tokens_per_s=round(tokens * 1e3 / ms, 1) if phase == "decode" else None,
                a2a_ms=_sig(a2a_ms),
                a2a_share=_sig(a2a_ms / ms),
                bytes_per_rank=sum(sent.values()),
                bytes_formula=sum(formula.values()),
                a2a_bytes=sent.get("all_to_all", 0),
            )
        )
    del llm
    release(device)
    return rows


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def baselines(path: Path | None, gpu: str, meta: dict) -> dict[tuple, float]:
    """One-GPU (tp = cp = 1) ms per step by (context, batch, phase) from earlier rows of `path` on the same GPU
    model, preset, dtype and layers; later rows win."""
    found: dict[tuple, float] = {}
    if path is None or not path.exists():
        return found
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        same = all(r.get(k) == meta[k] for k in ("preset", "dtype", "layers")) and r.get("gpu") == gpu
        if same and (r.get("tp"), r.get("cp")) == (1, 1) and "ms_per_step" in r:
            found[r["context"], r["batch"], r["phase"]] = r["ms_per_step"]
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = init_distributed(timeout_s=args.timeout) if world > 1 else None
    device = ctx.device if ctx is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank = ctx.rank if ctx is not None else 0
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = truncated_config(args.preset, args.layers)
    meta = {**run_metadata(), "preset": args.preset, "dtype": str(dtype).removeprefix("torch."),
            "layers": config.num_hidden_layers, "world": world}  # fmt: skip
    base = baselines(args.out, meta["gpu"], meta)
    cases = layouts(world, args.cp)
    if not cases:
        raise SystemExit(f"--cp {args.cp} does not divide the world size {world}")
    if rank == 0:
        print(f"{args.preset}, {config.num_hidden_layers} layers, {meta['dtype']}, {world} rank(s): {cases}")
    rows: list[dict] = []
    try:
        with JsonlWriter(args.out if rank == 0 else None, echo=sys.stderr if rank == 0 else None) as results:
            for tp, cp in cases:
                torch.manual_seed(0)  # the same weights on every rank, sharded by each
                model = None
                for context in args.contexts:
                    for batch in args.batches:
                        if model is None or world > 1:  # a parallel LLM shards its model in place
                            model = random_model(config, dtype, device)
                        for row in bench_case(model, args, tp, cp, context, batch, device):
                            key = (context, batch, row["phase"])
                            if (tp, cp) == (1, 1) and "ms_per_step" in row:
                                base[key] = row["ms_per_step"]
                            if key in base and "ms_per_step" in row:
                                row["speedup_vs_cp1"] = round(base[key] / row["ms_per_step"], 3)
                            rows.append({**meta, **row})
                            results.write(rows[-1])
                        if world > 1:
                            model = None
                            release(device)
                del model
    finally:
        if ctx is not None:
            ctx.close()
    if rank == 0:
        print_markdown_table(rows, TABLE)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny preset, short contexts, few steps (CPU, seconds)")
    p.add_argument("--preset", default=None, help="model shapes (default: kimi-linear-48b-a3b; tiny with --smoke)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: 8; all with --smoke)")
    p.add_argument("--cp", type=int, default=None, choices=(1, 2, 4), help="only the layout with this cp")
    p.add_argument("--contexts", type=int_list, default=None, help="comma-separated (default: 32768,131072,524288)")
    p.add_argument("--batches", type=int_list, default=None, help="comma-separated (default: 1,8)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per phase (default: 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before each phase (default: 2)")
    p.add_argument("--k", type=int, default=4, help="drafts per request in a verify step")
    p.add_argument("--page-size", type=int, default=None, help="cache page, the Helix ownership unit (default: 64)")
    p.add_argument("--eager", action="store_true", help="LLM(enforce_eager=True): no CUDA graphs at cp = 1 either")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits for a peer before aborting")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSONL results (default: {DEFAULT_OUT})")
    args = p.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else GPU_CASES
    args.preset = args.preset or ("tiny" if args.smoke else "kimi-linear-48b-a3b")
    args.layers = args.layers if args.layers is not None or args.smoke else 8
    for name in ("contexts", "batches", "steps", "warmup", "page_size"):
        if getattr(args, name) is None:
            setattr(args, name, cases[name])
    for name in ("steps", "k", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.contexts) < 1 or min(args.batches) < 1 or args.warmup < 0:
        p.error("--contexts and --batches must be >= 1 and --warmup >= 0")
    return args


TABLE = ["tp", "cp", "context", "batch", "phase", "mode", "ms_per_step", "a2a_ms", "a2a_share", "bytes_per_rank",
         "bytes_formula", "speedup_vs_cp1", "skipped"]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
