"""Where a decoding round's time goes: host wall time per engine phase, and the GPU's kernels, per round.

    python scripts/profile_round.py                      # plain and dspark k=5 on the demo model, batch 1
    python scripts/profile_round.py --methods plain ngram dspark --k 3
    python scripts/profile_round.py --count --device cpu  # launches and syncs per phase (scripts/count_launches.py)
    python scripts/profile_round.py --kda-warps 1         # with the KDA decode/verify kernel at 1 warp

For each method it builds the engine as `bench_spec.py` does, warms up, then times one prompt's `generate`
twice: first with wall-clock wrappers around the engine's phases (propose, schedule, runner, observe, verify,
sample, accept, rollback; inclusive times, no device syncs added), then under `torch.profiler` for the GPU
kernels. It prints ms per step type (prefill, decode, round), the phases' host ms per round, the kernels of most
GPU time and the profiled host ops of most own CPU time, per round. Nothing is written to benchmarks/results: this
is a diagnosis, not a result.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_spec  # noqa: E402

from kimi_helix.assets import default_drafter_dir, demo_model_dir  # noqa: E402
from kimi_helix.engine import LLM, SamplingParams  # noqa: E402
from kimi_helix.modeling.checkpoint import read_config  # noqa: E402


def wrap(totals: dict, counts: dict, owner, name: str, label: str) -> None:
    """Replace `owner.name` by a wrapper adding its inclusive wall time to totals[label]."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t0
            counts[label] += 1

    setattr(owner, name, timed)


def instrument(llm: LLM) -> tuple[dict, dict]:
    totals, counts = defaultdict(float), defaultdict(int)
    spec = llm.speculative
    targets = [(llm.scheduler, "schedule", "schedule"), (llm.runner, "run", "runner"),
               (llm.runner, "prepare", "runner.prepare"), (llm.cache, "rollback", "cache.rollback"),
               (llm, "_accept", "accept")]  # fmt: skip
    if llm.runner.graphs is not None:
        targets.append((llm.runner.graphs, "run", "runner.graphs"))
    if spec is not None:
        targets += [(spec, "propose", "propose"), (spec, "observe", "observe"), (spec, "verify_groups", "verify"),
                    (spec.proposer, "rollback", "proposer.rollback")]  # fmt: skip
        drafts = getattr(spec.proposer, "graphs", None)
        if drafts is not None:
            targets += [(drafts, "run", "draft.graph"), (drafts, "write", "draft.write")]
    import kimi_helix.engine.llm as llm_module

    totals_sample = (llm_module, "sample", "sample")
    for owner, name, label in [*targets, totals_sample]:
        wrap(totals, counts, owner, name, label)
    return totals, counts


def step_kinds(steps) -> dict[str, list[float]]:
    kinds = defaultdict(list)
    for s in steps:
        if s.verify_groups:
            kinds["round"].append(s.seconds)
        elif s.scheduled_tokens == s.generated_tokens:
            kinds["decode"].append(s.seconds)
        else:
            kinds["prefill"].append(s.seconds)
    return kinds


def profile(model_dir: Path, prompt, method: str, k: int, drafter, args) -> None:
    spec = bench_spec.speculative_config(method, k, drafter, args)
    max_len = len(prompt) + args.max_tokens + k + 1
    llm = LLM(model_dir, device=args.device, page_size=16, max_num_seqs=1, max_model_len=max_len,
              num_pages=4 * -(-max_len // 16), speculative_config=spec)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        llm.generate([prompt], params, use_tqdm=False)
    totals, counts = instrument(llm)
    first = len(llm.metrics)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t0
    kinds = step_kinds(llm.metrics[first:])
    rounds = len(kinds.get("round", [])) or len(kinds.get("decode", []))
    print(f"\n== {method} k={k}: {args.max_tokens} tokens in {1e3 * wall:.2f} ms; steps:", end="")
    for kind, secs in kinds.items():
        print(f" {kind} {len(secs)} x {1e3 * sum(secs) / len(secs):.3f} ms", end="")
    print(f"\nhost ms per round (inclusive, {rounds} rounds):")
    for label in sorted(totals, key=lambda x: -totals[x]):
        print(f"  {label:<20}{1e3 * totals[label] / rounds:8.3f}   calls {counts[label]}")
    gpu_kernels(llm, [prompt], params, sync, rounds, "round", args.top)
    if method != "plain":
        host_hotspots(lambda: (llm.generate([prompt], params, use_tqdm=False), sync()), args.top, "the generate")
    if method == "plain":  # the prompt's step alone: one token
        one = SamplingParams(max_tokens=1, temperature=0.0)
        gpu_kernels(llm, [prompt], one, sync, 1, "prefill", args.top)
        host_hotspots(lambda: (llm.generate([prompt], one, use_tqdm=False), sync()), args.top, "the prefill step")


def host_hotspots(fn, top: int, what: str) -> None:
    """The Python functions of most own time in `fn()`, and the package's of most inclusive time (cProfile)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    print(f"host hotspots of {what} (cProfile, own time):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    print(f"the package's functions in {what} (cProfile, inclusive time):")
    pstats.Stats(prof).sort_stats("cumulative").print_stats("kimi_helix", 2 * top)


def gpu_kernels(llm: LLM, prompts, params, sync, per: int, what: str, top: int) -> None:
    """Profile one `generate` and print its GPU kernels per `what` (divided by `per`)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        sync()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events)
    print(f"GPU per {what}: {gpu_us / per:.1f} us busy, {launches / per:.1f} kernels; top kernels:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / per:8.1f} us {e.count / per:6.1f}x  {e.key[:90]}")
    host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    print(f"host per {what}: {sum(e.self_cpu_time_total for e in host) / per:.1f} us in profiled ops; top ops:")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.self_cpu_time_total / per:8.1f} us {e.count / per:6.1f}x  {e.key[:90]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["plain", "dspark"], choices=("plain", "ngram", "dspark"))
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=25, help="kernels listed per method")
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--count", action="store_true", help="count launches and syncs per phase instead (eager)")
    p.add_argument("--kda-warps", type=int, choices=(1, 2, 4, 8), help="force the KDA decode/verify kernel's warps")
    args = p.parse_args(argv)
    if args.kda_warps is not None:
        from kimi_helix.kernels.kda import fused_recurrent

        chosen = fused_recurrent._config
        fused_recurrent._config = lambda *shape: (chosen(*shape)[0], args.kda_warps, chosen(*shape)[2])
    if args.count:
        import count_launches

        sizes = ["--k", str(args.k), "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
        return count_launches.main(["--methods", *args.methods, *sizes, "--device", args.device])
    args.num_prompts, args.seed, args.prompts = 1, 0, None
    model_dir = demo_model_dir()
    drafter = default_drafter_dir(model_dir)
    prompt = bench_spec.heldout_prompts(args, Path(model_dir), read_config(Path(model_dir)).vocab_size)[0]
    for method in args.methods:
        profile(Path(model_dir), prompt, method, args.k if method != "plain" else 0, drafter, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
