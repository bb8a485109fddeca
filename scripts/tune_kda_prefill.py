"""Sweep the launch parameters of the Triton KDA prefill's chunk-parallel kernels on a GPU.

    python scripts/tune_kda_prefill.py --out $OUT     # T=8192, H=64, K=V=128, bf16 (the target case)
    python scripts/tune_kda_prefill.py --out $OUT --tables INTRA_BOUNDED --lower-bound -5   # the bounded (K3) gate
    python scripts/tune_kda_prefill.py --smoke        # two candidates per kernel on tiny shapes (CPU interpreter)

One kernel at a time (gate, intra, the per-half pass, the block fallback, WY, state, output) runs every candidate
of its table while the others keep the settings in kimi_helix/kernels/kda/chunk.py; each candidate is timed as the
whole chunk_kda call, as bench_kda.py calls it. The intra table is INTRA for a given decay and INTRA_BOUNDED for
the bounded gate (--lower-bound); each is timed only with the gate that uses it.
Candidates are compiled first by a pool of worker processes (Triton's on-disk cache is shared). One JSON object
per timing goes to <out>/tune_kda_prefill.jsonl; the best per kernel is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Sweeps are history, not current results: docs/benchmarks.md reads benchmarks/results/*.jsonl only.
HISTORY = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "history"
from bench_common import JsonlWriter, bench_ms, precompile, run_metadata  # noqa: E402
from bench_kda import prefill_inputs  # noqa: E402

from kimi_helix.kernels.kda import chunk  # noqa: E402


def _grid(**axes) -> list[dict]:
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


# INTRA and INTRA_BOUNDED (the same kernels, for the two kinds of gate) share one grid: the chunk-wide kernel's
# settings with or without the per-half pass after it; their launch settings reach only the chunk-wide kernel (HALVES
# and BLOCKS launch the others), so the passes without it are one candidate each (in CANDIDATES).
_INTRA_GRID = [
    dict(wide=True, halves=h, **c)
    for h in (False, True)
    for c in _grid(BKS=[16, 32], num_warps=[4, 8], num_stages=[3], maxnreg=[None])
    + _grid(BKS=[16, 32], num_warps=[4], num_stages=[3], maxnreg=[168, 128])
]
_SMOKE_INTRA_GRID = _grid(wide=[True, False], halves=[True], BKS=[16], num_warps=[4], num_stages=[1], maxnreg=[128])
CANDIDATES = {
    "GATE": _grid(BK=[16, 32, 64, 128], num_warps=[2, 4, 8]),
    "INTRA": _INTRA_GRID + [dict(chunk.INTRA, wide=False, halves=h) for h in (True, False)],
    "INTRA_BOUNDED": _INTRA_GRID + [dict(chunk.INTRA_BOUNDED, wide=False, halves=h) for h in (True, False)],
    "HALVES": _grid(BKS=[16, 32], num_warps=[4, 8], num_stages=[3], maxnreg=[None, 168, 128]),
    "BLOCKS": _grid(BKS=[16, 32], num_warps=[2, 4], num_stages=[2, 3], maxnreg=[None], side_stream=[True])
    + _grid(BKS=[16], num_warps=[2, 4], num_stages=[3], maxnreg=[168, 128], side_stream=[True])
    + [dict(chunk.BLOCKS, side_stream=False)],
    "WY": _grid(split=[False, True], BS=[16, 32, 64], num_warps=[4, 8], num_stages=[1, 3], maxnreg=[None])
    + _grid(split=[False], BS=[32, 64], num_warps=[4, 8], num_stages=[3], maxnreg=[128]),
    # with o in the state pass only 4 warps are allowed (chunk._check_state_table)
    "STATE": _grid(output=[True], BV=[16, 32, 64], num_warps=[4], num_stages=[1, 2, 3])
    + _grid(output=[False], BV=[32, 64], num_warps=[4, 8], num_stages=[3]),
    "OUTPUT": _grid(BV=[32, 64, 128], num_warps=[4, 8], num_stages=[1, 3]),
}
SMOKE_CANDIDATES = {
    "GATE": _grid(BK=[16], num_warps=[2, 4]),
    "INTRA": _SMOKE_INTRA_GRID,
    "INTRA_BOUNDED": _SMOKE_INTRA_GRID,
    "HALVES": _grid(BKS=[16], num_warps=[4], num_stages=[1], maxnreg=[None, 128]),
    "BLOCKS": _grid(BKS=[16], num_warps=[2], num_stages=[1], maxnreg=[None, 128], side_stream=[True]),
    "WY": _grid(split=[False, True], BS=[16], num_warps=[4], num_stages=[1], maxnreg=[None, 128]),
    "STATE": _grid(output=[True, False], BV=[16, 32], num_warps=[4], num_stages=[1]),
    "OUTPUT": _grid(BV=[16, 32], num_warps=[4], num_stages=[1]),
}


def make_call(T: int, H: int, D: int, lower_bound: float | None, dtype, device):
    """The timed call: bench_kda's prefill inputs with the decay g given (lower_bound None), or with the bounded
    gate computed in the kernel from the raw pre-activation, as bench_kda's `triton_gate` backend runs it."""
    x = prefill_inputs(T, H, D, dtype, device)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    if lower_bound is None:
        return lambda: chunk.chunk_kda_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    gate = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lower_bound)
    return lambda: chunk.chunk_kda_triton(x["q"], x["k"], x["v"], x["f"], x["beta"], **gate, **kw)


def _compile(job) -> None:
    """Worker: run chunk_kda once with one kernel's candidate so that Triton compiles and caches it."""
    table, cfg, shape = job
    setattr(chunk, table, cfg)
    make_call(*shape, torch.bfloat16, torch.device("cuda"))()
    torch.cuda.synchronize()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument(
        "--out", default=HISTORY, help="directory for tune_kda_prefill.jsonl (default: benchmarks/results/history)"
    )
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--lower-bound", type=float, default=None, help="time the in-kernel bounded gate, not a given g")
    ap.add_argument("--tables", nargs="+", choices=list(CANDIDATES), help="default: every table the gate uses")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compiling processes")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.lower_bound is not None and not args.lower_bound < 0:
        ap.error(f"--lower-bound must be negative, got {args.lower_bound}")
    # chunk_kda reads INTRA for a given decay and INTRA_BOUNDED for the bounded gate, never both
    unused, when = ("INTRA", "with") if args.lower_bound is not None else ("INTRA_BOUNDED", "without")
    reasons = {unused: f"is not used {when} --lower-bound"}
    if chunk.STATE["output"]:  # the output kernel runs only where the state pass leaves o to it
        reasons["OUTPUT"] = "is not used while STATE['output'] computes o in the state pass"
    if args.tables is None:
        args.tables = [t for t in CANDIDATES if t not in reasons]
    for table in set(args.tables) & set(reasons):
        ap.error(f"--tables {table} {reasons[table]}")
    dims = (40, 2, 16) if args.smoke else (args.T, args.H, 128)
    dtype, shape = (torch.float16 if args.smoke else torch.bfloat16), (*dims, args.lower_bound)
    cands = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    jobs = [(t, c, shape) for t in args.tables for c in cands[t]]
    errors = dict(zip(((t, str(c)) for t, c, _ in jobs), precompile(_compile, jobs, args.jobs, device)))

    defaults = {t: getattr(chunk, t) for t in cands}
    call = make_call(*shape, dtype, device)
    best = {}
    path = Path(args.out) / "tune_kda_prefill.jsonl"
    with JsonlWriter(path) as results:
        for table in args.tables:
            timed = []
            for cfg in cands[table]:
                rec = dict(run_metadata(), T=shape[0], H=shape[1], K=shape[2], lower_bound=shape[3], table=table,
                           config=cfg, ms=None,
                           error=errors.get((table, str(cfg))))  # fmt: skip
                if rec["error"] is None:
                    setattr(chunk, table, cfg)
                    try:
                        rec["ms"] = round(bench_ms(call, device, cpu_reps=1), 4)
                        timed.append((rec["ms"], str(cfg)))
                    except Exception as err:
                        rec["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                    setattr(chunk, table, defaults[table])
                results.write(rec)
            if timed:
                best[table] = min(timed)
    print("\nbest per kernel (whole chunk_kda ms, others at their defaults):")
    for table, (ms, cfg) in best.items():
        print(f"  {table} = {cfg}  # {ms:.4f} ms (default {defaults[table]})")
    return results.records


if __name__ == "__main__":
    main()
