"""Speculative decoding on a real model: plain vs ngram vs DSpark, greedy, on held-out prompts.

    python scripts/bench_spec.py                          # the demo model and its shipped drafter, on the GPU
    python scripts/bench_spec.py --drafter DRAFT_DIR      # a drafter from scripts/train_drafter.py
    python scripts/bench_spec.py --model DIR --drafter DRAFT_DIR --prompts prompts.txt
    python scripts/bench_spec.py --smoke                  # a tiny random model and drafter on the CPU, seconds

Prompts are held out from the drafter's training: lines of the held-out split of the demo corpus
(`scripts/demo_prompts.py`; the drafter trains on the train split), or the last tenth of `--prompts`, cut to
`--prompt-len` tokens. Each method (plain; ngram and dspark at every `--k`) gets its own `LLM` at every batch
size in `--batch-sizes`: the prompts run `batch` at a time, greedy, `--max-tokens` new tokens each (EOS ignored,
so every case decodes the same number of tokens), after an untimed warm-up pass over the same prompts: greedy
decoding then meets exactly the step shapes it met in the warm-up, so every CUDA graph (target steps, verify
groups of each length, draft rounds of each k) is captured before the clock starts.

Per case: tokens/s (generated tokens over the wall clock of the timed `generate` calls), the speedup over plain
decoding at the same batch size, `decode_tokens_per_s` (the tokens after each prompt's first, over the wall clock
from the host's read of a call's first token to the call's return, `RequestOutput.metrics`: the decoding phase
alone, without the prefill that every method pays alike; `first_token_s` is the rest of the wall clock;
`decode_speedup` is the ratio to plain's) and tokens per engine step (the batch size for plain decoding); for
speculative cases tau (tokens per verify round, the bonus token included; None when no step had drafts) and
acceptance by position, from `LLM.speculative.metrics`; and `identical`, how many prompts' outputs equal plain
decoding's token for token. `plain` replays CUDA graphs on the GPU, and `plain-eager`
is the same engine with `enforce_eager`. `ms_per_round` is the mean wall time of a decoding round (an engine step
that verified drafts; for plain decoding a decode step), on the graph path on the GPU: target verify steps and
greedy drafting rounds replay CUDA graphs. Rows (with gpu, date and commit) are appended to
benchmarks/results/spec.jsonl (or --out); a table ends the run. With `--repeats N` every case runs N times, the
cases alternating (plain first each time, and each speedup against that run's plain), every run is a row (with
its `repeat`), and the table shows each case's medians: at batch 1 a round's wall time follows the host's jitter.
A case that fails is written as a row with its `error` and the run goes on; the exit status is then 1."""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, demo_prompts, also when loaded by path
from bench_common import JsonlWriter, run_metadata  # noqa: E402

from kimi_helix.assets import default_drafter_dir, demo_model_dir  # noqa: E402
from kimi_helix.engine import LLM, SamplingParams  # noqa: E402
from kimi_helix.speculative.engine import SpeculativeMetrics  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "spec.jsonl"
METHODS = ("plain", "plain-eager", "ngram", "dspark")
SMOKE = dict(k=[1, 3], batch_sizes=[1, 2], num_prompts=2, prompt_len=8, max_tokens=8, device="cpu", out=None)
PAGE_SIZE = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, metavar="DIR", help="the target folder (default: the demo model)")
    src.add_argument("--smoke", action="store_true", help="a tiny random model and drafter on the CPU")
    p.add_argument(
        "--drafter", type=Path, metavar="DIR", help="DSpark drafter folder (default: the demo's shipped one)"
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--k", type=int, nargs="+", default=[1, 3, 5], help="drafts per round (num_speculative_tokens)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=Path, help="a text file; its last tenth gives the prompts (default: demo corpus)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="ngram: shortest n-gram matched")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest n-gram matched")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: the checkpoint's")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--seed", type=int, default=0, help="which held-out prompts")
    p.add_argument("--repeats", type=int, default=1, help="runs of every case, alternating; the table: medians")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL file the rows are appended to")
    p.add_argument("--no-out", dest="out", action="store_const", const=None, help="write no JSONL file")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**SMOKE)  # explicit options still win
    args = parser.parse_args(argv)
    for name in ("num_prompts", "prompt_len", "max_tokens", "prompt_lookup_min", "prompt_lookup_max", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.k) < 1 or min(args.batch_sizes) < 1:
        parser.error(f"--k and --batch-sizes must be >= 1, got {args.k} and {args.batch_sizes}")
    return args


def smoke_folders(workdir: Path) -> tuple[Path, Path]:
    """A tiny random target (fp32, KDA and MLA layers) and an untrained DSpark drafter for it, saved in workdir."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_drafter import build_drafter
    from train_drafter import build_parser as drafter_parser

    from kimi_helix.modeling import KimiK3ForCausalLM
    from kimi_helix.presets import get_preset

    torch.manual_seed(0)
    target = KimiK3ForCausalLM(get_preset("tiny"))
    target.save_pretrained(workdir / "target")
    drafter_args = drafter_parser().parse_args(["--smoke", "--out", str(workdir), "--layers", "1", "--block-size", "5"])
    drafter_args.markov_rank = 8
    build_drafter(drafter_args, target, torch.device("cpu")).save_pretrained(workdir / "drafter")
    return workdir / "target", workdir / "drafter"


def heldout_prompts(args, model_dir: Path, vocab: int) -> list[list[int]]:
    """`--num-prompts` held-out prompts of `--prompt-len` token ids (random ids for a folder without tokenizer)."""
    from kimi_helix.tokenizer import load_tokenizer

    if not (model_dir / "tokenizer_config.json").is_file():
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, min(vocab, 256), (args.num_prompts, args.prompt_len), generator=gen).tolist()
    tokenizer = load_tokenizer(model_dir)
    if args.prompts is None:
        from demo_prompts import corpus_prompts

        return corpus_prompts(tokenizer, "heldout", args.num_prompts, args.prompt_len, args.seed)
    lines = [ln for ln in args.prompts.read_text().splitlines() if ln.strip()]
    ids = [t for ln in lines for t in tokenizer(ln, add_special_tokens=False).input_ids]
    ids = ids[len(ids) * 9 // 10 :]
    stride = max(1, (len(ids) - args.prompt_len) // args.num_prompts)
    prompts = [ids[i : i + args.prompt_len] for i in range(0, len(ids) - args.prompt_len + 1, stride)]
    if len(prompts) < args.num_prompts:
        raise SystemExit(f"--prompts {args.prompts}: its last tenth holds fewer than {args.num_prompts} prompts")
    return prompts[: args.num_prompts]


def speculative_config(method: str, k: int, drafter: Path | None, args) -> dict | None:
    if method == "ngram":
        return dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=args.prompt_lookup_min,
                    prompt_lookup_max=args.prompt_lookup_max)  # fmt: skip
    if method == "dspark":
        return dict(method="dspark", model=str(drafter), num_speculative_tokens=k)
    return None


def run_case(model_dir: Path, prompts, method: str, k: int, batch: int, drafter, args) -> tuple[dict, list]:
    """One method at one k and batch size: (the row's measurements, each prompt's generated token ids)."""
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    spec = speculative_config(method, k, drafter, args)
    max_len = args.prompt_len + args.max_tokens + max(args.k) + 1
    pages = (batch + 1) * -(-max_len // PAGE_SIZE) + 2
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, page_size=PAGE_SIZE, max_num_seqs=batch,
              max_model_len=max_len, num_pages=pages, speculative_config=spec,
              enforce_eager=method == "plain-eager")  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(0, len(prompts), batch):  # the timed pass's shapes, so no graph is captured while timed
        llm.generate(prompts[i : i + batch], params, use_tqdm=False)
    if llm.speculative is not None:
        llm.speculative.metrics = SpeculativeMetrics()  # the timed calls only
    first_step = len(llm.metrics)
    outputs, seconds, first_token_s = [], 0.0, 0.0
    for i in range(0, len(prompts), batch):
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        sync()
        seconds += time.perf_counter() - t0
        first_token_s += min(o.metrics.first_token_time for o in outs) - t0
        outputs += [list(o.token_ids) for o in outs]
    tokens = sum(len(o) for o in outputs)
    steps = llm.metrics[first_step:]
    row = dict(method=method, k=k if spec else 0, batch_size=batch, tokens=tokens, seconds=round(seconds, 4),
               tokens_per_s=round(tokens / seconds, 1), steps=len(steps), tokens_per_step=round(tokens / len(steps), 3),
               first_token_s=round(first_token_s, 4),
               decode_tokens_per_s=round((tokens - len(prompts)) / max(seconds - first_token_s, 1e-9), 1),
               ms_per_step=round(1e3 * sum(s.seconds for s in steps) / len(steps), 3),
               ms_per_round=ms_per_round(steps, speculative=spec is not None))  # fmt: skip
    if llm.speculative is not None:
        m = llm.speculative.metrics
        accept = [round(a, 3) for a in m.acceptance_by_position]
        row.update(tau=round(m.tau, 3) if m.rounds else None, rounds=m.rounds, acceptance_by_position=accept)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, outputs


def ms_per_round(steps, speculative: bool) -> float | None:
    """Mean host wall time of a decoding round: the steps that verified drafts (speculative methods), or the
    steps where every scheduled token was a decode that emitted one (plain); None when there is none."""
    if speculative:
        rounds = [s.seconds for s in steps if s.verify_groups]
    else:
        rounds = [s.seconds for s in steps if s.scheduled_tokens == s.generated_tokens]
    return round(1e3 * sum(rounds) / len(rounds), 3) if rounds else None


def cases(args, drafter) -> list[tuple[str, int]]:
    """(method, k) in run order: plain first, as every speedup and identity check is against it."""
    out = []
    for method in args.methods:
        if method == "plain-eager" and torch.device(args.device).type != "cuda":
            continue  # no CUDA graphs off the GPU: the same as plain
        if method == "dspark" and drafter is None:
            print("dspark skipped: no --drafter and no shipped drafter for this model", file=sys.stderr)
            continue
        out += [(method, k) for k in (args.k if method in ("ngram", "dspark") else [0])]
    return sorted(out, key=lambda c: c[0] != "plain")


MEDIAN_KEYS = ("tokens_per_s", "speedup", "decode_tokens_per_s", "decode_speedup", "tokens_per_step", "ms_per_round",
               "tau")  # fmt: skip


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (batch, method, k): the median of each of MEDIAN_KEYS over its runs without error, the fewest
    prompts identical to plain, the first run's acceptance by position; a case with no good run keeps an error
    row."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["batch_size"], r["method"], r["k"]), []).append(r)
    out = []
    for runs in groups.values():
        good = [r for r in runs if "error" not in r]
        if not good:
            out.append(runs[0])
            continue
        row = dict(good[0])
        for key in MEDIAN_KEYS:
            values = [r[key] for r in good if r.get(key) is not None]
            row[key] = statistics.median(values) if values else row.get(key)
        identical = [r["identical"] for r in good]
        row["identical"] = None if None in identical else min(identical)
        out.append(row)
    return out


def print_table(rows: list[dict]) -> None:
    head = (f"{'method':<12}{'k':>3}{'batch':>7}{'tok/s':>10}{'speedup':>9}{'decode':>10}{'speedup':>9}"
            f"{'tok/step':>9}{'ms/round':>9}{'tau':>7}{'same':>7}  acceptance by position")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in sorted(rows, key=lambda r: (r["batch_size"], METHODS.index(r["method"]), r["k"])):
        if "error" in r:
            print(f"{r['method']:<12}{r['k']:>3}{r['batch_size']:>7}  failed: {r['error'][:80]}")
            continue
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
        accept = " ".join(f"{a:.2f}" for a in r.get("acceptance_by_position", []))
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
        decode_speed = f"{r['decode_speedup']:.2f}x" if r.get("decode_speedup") is not None else "-"
        same = "-" if r["identical"] is None else f"{r['identical']}/{r['num_prompts']}"
        per_round = "-" if r.get("ms_per_round") is None else f"{r['ms_per_round']:.2f}"
        print(f"{r['method']:<12}{r['k']:>3}{r['batch_size']:>7}{r['tokens_per_s']:>10.1f}{speed:>9}"
              f"{r['decode_tokens_per_s']:>10.1f}{decode_speed:>9}{r['tokens_per_step']:>9.2f}{per_round:>9}{tau:>7}"
              f"{same:>7}  {accept}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            model_dir, default_drafter = smoke_folders(Path(tmp))
        else:
            model_dir = args.model or demo_model_dir()
            default_drafter = default_drafter_dir(model_dir)
        drafter = args.drafter or default_drafter
        from kimi_helix.modeling.checkpoint import read_config

        prompts = heldout_prompts(args, Path(model_dir), read_config(Path(model_dir)).vocab_size)
        meta = dict(bench="spec", **run_metadata(), model="smoke-tiny" if args.smoke else str(model_dir),
                    drafter=None if drafter is None else str(drafter), dtype=args.dtype or "checkpoint",
                    num_prompts=len(prompts), prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                    greedy=True)  # fmt: skip
        rows, plain = [], {}
        with JsonlWriter(args.out) as results:
            for batch in args.batch_sizes:
                for repeat in range(args.repeats):  # alternating, so that a host's drift reaches every case alike
                    for method, k in cases(args, drafter):
                        row = measured_row(Path(model_dir), prompts, method, k, batch, drafter, args, plain)
                        rows.append({**meta, **row, "repeat": repeat})
                        results.write(rows[-1])
    if args.repeats > 1:
        print(f"medians of {args.repeats} runs per case (each speedup against the same run's plain decoding):")
    print_table(median_rows(rows) if args.repeats > 1 else rows)
    for r in rows:
        where = f"{r['method']} k={r['k']} batch {r['batch_size']}"
        if "error" in r:
            print(f"error: {where}: {r['error']}", file=sys.stderr)
        elif r["identical"] is not None and r["identical"] < r["num_prompts"]:
            differ = r["num_prompts"] - r["identical"]
            print(f"note: {where}: {differ} prompts differ from plain greedy", file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


def measured_row(model_dir: Path, prompts, method: str, k: int, batch: int, drafter, args, plain: dict) -> dict:
    """`run_case` with the speedup and identity against plain decoding at this batch size (`plain` keeps its
    outputs); a case that raises becomes a row with its `error`, and the run goes on."""
    try:
        row, outputs = run_case(model_dir, prompts, method, k, batch, drafter, args)
    except Exception as err:  # one broken case must not lose the others' rows
        traceback.print_exc()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return dict(method=method, k=k, batch_size=batch, error=f"{type(err).__name__}: {str(err)[:300]}")
    if method == "plain":
        plain[batch] = (row, outputs)
    base = plain.get(batch)
    row["speedup"] = None if base is None else round(row["tokens_per_s"] / base[0]["tokens_per_s"], 3)
    plain_decode = None if base is None else base[0]["decode_tokens_per_s"]
    row["decode_speedup"] = None if base is None else round(row["decode_tokens_per_s"] / plain_decode, 3)
    row["identical"] = None if base is None else sum(a == b for a, b in zip(outputs, base[1]))
    return row


if __name__ == "__main__":
    sys.exit(main())
