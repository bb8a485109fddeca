"""Host time of staging one engine step: `ModelRunner.prepare` of a verify step (1 + k tokens a sequence).

    python scripts/bench_staging.py                          # demo model, CPU, batch 1 8 64, k = 5
    python scripts/bench_staging.py --batch-sizes 1,16 --k 4 --device cuda
    python scripts/bench_staging.py --smoke                  # a tiny random model, seconds

In a speculative round the host stages the next verify step after it has read the last one's acceptance, so
this time sits between two rounds' GPU work (docs/speculative.md, "Not done yet"). The engine is built on the
chosen device, its sequences prefilled once, and then the same verify step is prepared `--calls` times in each
of `--repeats` runs; the row keeps the fastest run's mean (the least disturbed by other work on the host). The
forward pass never runs: only the host's staging and its one upload.

Rows go to `--out` (default benchmarks/results/staging.jsonl): gpu ("cpu" off the GPU), date, commit, model,
device, batch, k, calls, us_per_call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import JsonlWriter, int_list, print_markdown_table, run_metadata  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def verify_step_llm(model, batch: int, k: int, device: str):
    """(an `LLM` on `model` whose `batch` sequences are prefilled and hold k drafts each, their verify step)."""
    from kimi_helix.engine import LLM, SamplingParams

    llm = LLM(model, device=device, max_num_seqs=batch, enforce_eager=True, max_draft_tokens=k)
    params = SamplingParams(max_tokens=4 * (k + 1), temperature=0.0, ignore_eos=True)
    for i in range(batch):
        llm.scheduler.add(llm._make_request([5 + i % 50, 6, 7, 8, 9] * 4, params))
    prefill = llm.scheduler.schedule()
    llm.runner.run(prefill)
    for request, n in zip(prefill.requests, prefill.num_tokens):
        request.num_computed += n
        request.output_ids.append(11)
        request.draft_token_ids = [3 + j for j in range(k)]
    return llm, llm.scheduler.schedule()


def time_prepare(llm, step, calls: int, repeats: int) -> float:
    """The fastest of `repeats` runs' mean µs a `runner.prepare(step)` call."""
    for _ in range(min(calls, 100)):  # warm the staging buffers' layout caches
        llm.runner.prepare(step)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            llm.runner.prepare(step)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the shipped demo model)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 64])
    p.add_argument("--k", type=int, default=5, help="drafts a sequence (the step has 1 + k tokens a sequence)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--smoke", action="store_true", help="a tiny random model and few calls (CPU, seconds)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "staging.jsonl"))
    args = p.parse_args(argv)
    if args.smoke:
        from kimi_helix import KimiK3ForCausalLM
        from kimi_helix.presets import get_preset

        torch.manual_seed(0)
        model, name = KimiK3ForCausalLM(get_preset("tiny")).eval(), "tiny (random)"
        args.calls, args.repeats, args.batch_sizes = 20, 2, [1, 3]
    else:
        from kimi_helix.assets import demo_model_dir

        model = args.model or str(demo_model_dir())
        name = model
    rows = []
    with JsonlWriter(args.out) as results:
        for batch in args.batch_sizes:
            llm, step = verify_step_llm(model, batch, args.k, args.device)
            us = time_prepare(llm, step, args.calls, args.repeats)
            row = dict(run_metadata(), bench="staging", model=name, device=args.device, batch=batch, k=args.k,
                       calls=args.calls, us_per_call=round(us, 1))  # fmt: skip
            results.write(row)
            rows.append(row)
    print_markdown_table(rows, ["gpu", "commit", "batch", "k", "us_per_call"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
