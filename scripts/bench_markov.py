"""The greedy DSpark Markov chain (`kernels/markov`): the Triton kernel against its torch reference at the demo
drafter's vocabulary and at Kimi's, timed as CUDA-graph replays (the drafter's rounds replay graphs).

    python scripts/bench_markov.py                 # V in {8192, 163840}, r = 32, rows {1, 8}, slots {5, 7}, bf16
    python scripts/bench_markov.py --smoke         # tiny shapes on the CPU (the interpreter): checks it runs

A chain reads W2 [V, r] once a slot and the base logits [N, K, V] fp32 once, so its bandwidth floor is
K * V * r * 2 + N * K * V * 4 bytes over the copy bandwidth measured in the same run; `pct_of_bw_floor` is the
share of that floor reached (latency, not bandwidth, bounds the demo's sizes). Rows go to
benchmarks/results/markov.jsonl, with the Triton kernel's tokens checked equal to the reference's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import JsonlWriter, bench_ms, copy_tbps, print_markdown_table, run_metadata  # noqa: E402

from kimi_helix.kernels.markov.naive import markov_chain_greedy_ref  # noqa: E402
from kimi_helix.kernels.markov.triton import markov_chain_greedy_triton  # noqa: E402

FULL = dict(vocabs=[8192, 163840], rank=32, hidden=2304, rows=[1, 8], slots=[5, 7])
SMOKE = dict(vocabs=[300], rank=8, hidden=16, rows=[1], slots=[3])
BACKENDS = {"torch_ref": markov_chain_greedy_ref, "triton": markov_chain_greedy_triton}


def inputs(vocab: int, rank: int, hidden: int, n: int, k: int, device, dtype):
    """Random chain arguments with a confidence head (the shipped drafter has one)."""
    gen = torch.Generator().manual_seed(vocab + n + k)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return (
        (rnd(n, k, vocab) * 3).to(device),
        torch.randint(0, vocab, (n,), generator=gen).to(device),
        rnd(vocab, rank).to(device, dtype),
        (rnd(vocab, rank) * 0.3).to(device, dtype),
        rnd(n, k, hidden).to(device, dtype),
        (rnd(hidden + rank) * 0.02).to(device, dtype),
        rnd(1).to(device, dtype),
    )


def main(argv=None) -> list[dict]:
    """Run the benchmark; returns the records written."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter): checks it runs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # the interpreter computes bf16 wrongly
    shape = SMOKE if args.smoke else FULL
    copy = copy_tbps(device, gib=1 / 1024 if args.smoke else 2)
    meta = dict(run_metadata(), rank=shape["rank"], dtype=str(dtype).removeprefix("torch."), copy_tbps=round(copy, 3))
    with JsonlWriter(Path(args.out) / "markov.jsonl", echo=sys.stderr) as results:
        for vocab, n, k in itertools.product(shape["vocabs"], shape["rows"], shape["slots"]):
            chain = inputs(vocab, shape["rank"], shape["hidden"], n, k, device, dtype)
            floor_ms = (k * vocab * shape["rank"] * 2 + n * k * vocab * 4) / (copy * 1e12) * 1e3
            same = torch.equal(markov_chain_greedy_triton(*chain)[0], markov_chain_greedy_ref(*chain)[0])
            for backend, fn in BACKENDS.items():
                ms = bench_ms(lambda fn=fn, chain=chain: fn(*chain), device, graph=device.type == "cuda")
                results.write(
                    dict(meta, vocab=vocab, rows=n, slots=k, backend=backend, ms=round(ms, 4),
                         us_per_slot=round(1e3 * ms / k, 2), floor_ms=round(floor_ms, 4),
                         pct_of_bw_floor=round(100 * floor_ms / ms, 1), tokens_equal_ref=same)
                )  # fmt: skip
    cols = ["vocab", "rows", "slots", "backend", "ms", "us_per_slot", "pct_of_bw_floor", "tokens_equal_ref"]
    print_markdown_table(results.records, cols)
    return results.records


if __name__ == "__main__":
    main()
