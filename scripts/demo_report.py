"""Report on a demo-model training run: loss-curve PNG, held-out bits per byte, samples, tokens/s, and the doc.

Reads the run folder of `scripts/train_target.py` (`loss.jsonl`, `summary.json`, `model/`) and the held-out tokens
of `scripts/prepare_corpus.py`; writes `docs/demo-model-loss.png` (needs matplotlib; skipped with a note when it is
not installed), `report.json` (in the run folder unless --report says otherwise) and `docs/demo-model.md`.
Everything here runs on the CPU.

    python scripts/demo_report.py --run out/demo
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kimi_helix.assets.demo_recipe import bits_per_byte, demo_config, token_byte_lengths  # noqa: E402
from kimi_helix.modeling.model import KimiK3ForCausalLM  # noqa: E402

PROMPT = "def fibonacci(n):"
DOC = REPO / "docs" / "demo-model.md"
PNG = REPO / "docs" / "demo-model-loss.png"


def read_log(run: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines() if line.strip()]
    return records, json.loads((run / "summary.json").read_text())


def plot_loss(records: list[dict], png: Path) -> bool:
    """Training loss against tokens seen; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss-curve PNG (pip install matplotlib)")
        return False
    start = next(r for r in records if r.get("event") == "start")
    points = [r for r in records if "event" not in r]
    tokens = [r["step"] * start["batch_size"] * start["seq_len"] / 1e6 for r in points]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(tokens, [r["loss"] for r in points], lw=1.2)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("train loss (nats / token)")
    ax.set_title("kimi-helix demo model")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return True


def sample(model, tokenizer, temperature: float | None, new_tokens: int) -> tuple[str, float]:
    """A completion of PROMPT (greedy, or sampled at `temperature` with seed 0) and its decode tokens/s."""
    ids = tokenizer(PROMPT, return_tensors="pt")
    torch.manual_seed(0)
    kwargs = {"do_sample": False} if temperature is None else {"do_sample": True, "temperature": temperature}
    start = time.perf_counter()
    out = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    seconds = time.perf_counter() - start
    return PROMPT + tokenizer.decode(out[0, ids["input_ids"].shape[1] :]), new_tokens / seconds


@torch.no_grad()
def prefill_tokens_per_s(model, seq_len: int, repeats: int = 3) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, seq_len))
    model(input_ids=ids, use_cache=False)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        model(input_ids=ids, use_cache=False)
    return repeats * seq_len / (time.perf_counter() - start)


def train_tokens_per_s(model, batch_size: int, seq_len: int, repeats: int = 2) -> float:
    """Forward + backward tokens/s of the training step (no optimiser), fp32 on the CPU."""
    ids = torch.randint(3, model.config.vocab_size, (batch_size, seq_len))
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    model.eval()
    return repeats * batch_size * seq_len / seconds


def measure(args) -> dict:
    from transformers import AutoTokenizer

    records, summary = read_log(args.run)
    model_dir = args.model or args.run / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    trained = KimiK3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    untrained = KimiK3ForCausalLM(demo_config(tokenizer)).eval()
    heldout = torch.from_numpy(np.load(args.data / "heldout.npy").astype(np.int64))
    lengths = token_byte_lengths(tokenizer, trained.config.vocab_size)
    bpb = {
        name: bits_per_byte(m, heldout, lengths, args.seq_len, 4, args.windows or None)
        for name, m in (("trained", trained), ("untrained", untrained))
    }
    greedy, decode_tok_s = sample(trained, tokenizer, None, args.new_tokens)
    sampled, _ = sample(trained, tokenizer, 0.8, args.new_tokens)
    gpu = [r["tok_per_s"] for r in records if "tok_per_s" in r][1:]  # the first window includes CUDA start-up
    weights = model_dir / "model.safetensors"
    return {
        "heldout_bpb": bpb["trained"],
        "untrained_heldout_bpb": bpb["untrained"],
        "bpb_windows": args.windows,
        "bpb_seq_len": args.seq_len,
        "greedy": greedy,
        "sampled_t0.8": sampled,
        "cpu_decode_tok_s": decode_tok_s,
        "cpu_prefill_tok_s": prefill_tokens_per_s(trained, args.seq_len),
        "cpu_train_tok_s": train_tokens_per_s(trained, 2, 128),
        "gpu_train_tok_s": statistics.median(gpu) if gpu else None,
        "params": summary["params"],
        "weights_mib": weights.stat().st_size / 2**20,
        "train": summary,
        "start": next(r for r in records if r.get("event") == "start"),
        "repro": next((r for r in records if r.get("event") == "repro"), None),
        "torch_threads": torch.get_num_threads(),
        "corpus": json.loads((args.data / "meta.json").read_text()),
    }


def render_doc(r: dict, png_written: bool) -> str:
    s, t, c = r["start"], r["train"], r["corpus"]
    repro = r["repro"]
    repro_line = (
        f"A second run of the first {repro['step']} steps from the same seed reached loss {repro['rerun_loss']:.6f} "
        f"against {repro['loss']:.6f} (difference {repro['abs_diff']:.2e}; target <= 1e-3)."
        if repro
        else "The reproducibility check was not run."
    )
    png = "![training loss](demo-model-loss.png)" if png_written else "(loss-curve PNG not generated: no matplotlib)"
    gpu = f"{r['gpu_train_tok_s']:,.0f}" if r["gpu_train_tok_s"] else "n/a"
    windows = f"{r['bpb_windows']} windows" if r["bpb_windows"] else "all windows"
    return f"""# The demo model

`kimi_helix/assets/demo/` ships a small trained Kimi-K3-style model, so that the package can show real text
without downloading weights: {r["params"] / 1e6:.1f}M parameters (bf16, {r["weights_mib"]:.1f} MiB of safetensors),
trained on the pure-Python sources of the CPython standard library and the English help topics of
`pydoc_data/topics.py`. It writes Python-looking code; it is far too small to write correct programs.

## Corpus

`scripts/prepare_corpus.py` collects the interpreter's standard library (`*.py` outside test folders and
site-packages) and `pydoc_data/topics.py`'s help topics, one document per topic. A document is held out when the
sha256 of its relative path falls in the lowest 5% (`kimi_helix/assets/demo/corpus_manifest.json` lists every
path with its sha256 and split; the text is not committed). Built with Python {c["python"]}:

| split | documents | MB of UTF-8 | tokens |
|---|---|---|---|
| train | {c["train"]["documents"]} | {c["train"]["bytes"] / 1e6:.2f} | {c["train"]["tokens"] / 1e6:.2f}M |
| held-out | {c["heldout"]["documents"]} | {c["heldout"]["bytes"] / 1e6:.2f} | {c["heldout"]["tokens"] / 1e6:.2f}M |

## Architecture

8 layers of width 256 (`kimi_helix/assets/demo_recipe.py`): KDA:MLA = 3:1 (layers 4 and 8 are MLA, 4 heads,
q-LoRA rank 128, latent rank 128, RoPE, output gate), KDA with 4 heads of 64, the lower-bounded forget gate (-5)
and the full-rank output gate; layer 1 has a dense SwiGLU MLP, layers 2-8 a sigmoid-routed MoE of 8 experts
(width 80, top 2) plus a shared expert; tied embeddings; a byte-level BPE of 8192 tokens. The size keeps the
repository light to clone and to copy whole to a GPU machine (<= 20 MiB of weights), and is about what a few
minutes of one GPU can train on the ~3M-token corpus.

## Commands

```bash
python scripts/prepare_corpus.py          # manifest, tokenizer, data/demo/{{train,heldout}}.npy
python scripts/train_target.py --out out/demo --max-minutes {s["max_minutes"]} --check-repro   # on one GPU
python scripts/train_target.py --smoke --out /tmp/smoke                     # CPU smoke run (CI)
cp out/demo/model/* kimi_helix/assets/demo/ && python scripts/demo_expected.py
python scripts/demo_report.py --run out/demo   # this page, the PNG
```

## Training

{t["steps"]} steps of {s["batch_size"]} x {s["seq_len"]} tokens ({t["tokens"] / 1e6:.1f}M tokens) in
{t["train_seconds"] / 60:.1f} minutes on one {t["device"]}: AdamW (lr {s["lr"]}, betas 0.9/0.95, weight decay
{s["weight_decay"]} on matrices), {s["warmup"]} warmup steps then cosine decay to {s["min_lr_ratio"]} x, bf16
autocast, gradient clipping at {s["clip"]}, seed {s["seed"]}. Every op runs its torch reference with autograd (the
Triton kernels are forward-only; fla's `chunk_kda` was not used). {repro_line}

{png}

## Results

| | held-out bits per byte |
|---|---|
| trained (this report: fp32 on the CPU, {windows}) | {r["heldout_bpb"]:.3f} |
| untrained, same init (fp32 on the CPU, {windows}) | {r["untrained_heldout_bpb"]:.3f} |
| trained (end of the training run: bf16 autocast, {s["eval_windows"]} windows) | {t["heldout_bpb"]:.3f} |

Windows of {r["bpb_seq_len"]} tokens, evenly spaced over the held-out split (the files whose path hash falls in
the lowest 5%; 44 files, 134k tokens, 262 windows in all); the end-of-document token costs bits but counts no
bytes. Subsets of the windows give different figures because the held-out files differ in kind (code, help text).

Completions of `{PROMPT}` (prompt not tuned):

Greedy:

```python
{r["greedy"]}
```

Sampled at T = 0.8 (seed 0):

```python
{r["sampled_t0.8"]}
```

## Speed

| | tokens/s |
|---|---|
| GPU training (fwd + bwd + AdamW, {t["device"]}, median of the logged windows) | {gpu} |
| CPU training fwd + bwd (fp32, 2 x 128 tokens, {r["torch_threads"]} thread(s)) | {r["cpu_train_tok_s"]:,.0f} |
| CPU prefill (fp32, {r["bpb_seq_len"]} tokens) | {r["cpu_prefill_tok_s"]:,.0f} |
| CPU decode (HF `generate`, greedy) | {r["cpu_decode_tok_s"]:,.1f} |

The CPU figures come from a shared 2-core machine and are indicative only.
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the --out folder of train_target.py")
    ap.add_argument("--model", type=Path, default=None, help="the trained model folder (default: RUN/model)")
    ap.add_argument("--data", type=Path, default=REPO / "data" / "demo")
    ap.add_argument("--windows", type=int, default=0, help="held-out windows for bits per byte (0: all)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="seed of the untrained model (train_target.py's --seed)")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--png", type=Path, default=PNG)
    ap.add_argument("--report", type=Path, default=None, help="the measurements as json (default: RUN/report.json)")
    args = ap.parse_args(argv)
    report = measure(args)
    png_written = plot_loss(read_log(args.run)[0], args.png)
    (args.report or args.run / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    args.doc.write_text(render_doc(report, png_written))
    print(json.dumps({k: v for k, v in report.items() if k not in ("train", "start")}, indent=1))


if __name__ == "__main__":
    main()
