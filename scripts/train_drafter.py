"""Distil a DSpark drafter for a kimi-helix target with DeepSpec's loss (0.1 CE + 0.9 L1 + 1.0 BCE, exp(-k/4)).

    python scripts/train_drafter.py --target DIR --prompts prompts.txt --out DRAFT_DIR   # GPU: the real run
    python scripts/train_drafter.py --target DIR --out DRAFT_DIR --resume                # continue where it stopped
    python scripts/train_drafter.py --smoke --out /tmp/draft                             # tiny random target, CPU

The target regenerates the training text itself: prompts (windows of `--prompt-len` tokens from `--prompts`,
tokenized with the target folder's tokenizer, or random tokens without it) are continued by the target for
`--gen-len` tokens (greedy, or sampled at `--gen-temperature`), once, before training. Each step draws a batch of
those sequences, runs the frozen target with forward hooks on the captured layers, samples `--anchors` anchors per
sequence in the generated part, and trains the drafter on the teacher-forced blocks. The embedding and LM head are
the target's, frozen. Every `--save-every` steps (and at the end) `OUT/checkpoint/` holds the drafter, the
optimizer and the step, so `--resume` continues exactly; `OUT/` holds the finished drafter (config.json and
model.safetensors, without the shared embedding and head).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kimi_helix.modeling import KimiK3ForCausalLM
from kimi_helix.presets import get_preset
from kimi_helix.speculative.dspark import DSparkConfig, DSparkDrafter, TargetFeatureCapture, default_target_layer_ids
from kimi_helix.speculative.dspark.loss import dspark_loss

STATE_FILE = "train_state.json"
OPTIMIZER_FILE = "optimizer.pt"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", type=Path, metavar="DIR", help="the target checkpoint folder")
    src.add_argument("--smoke", action="store_true", help="a tiny random target on the CPU, a few quick steps")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the drafter is written")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--prompts", type=Path, help="a text file of prompts (default: random tokens)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-sequences", type=int, default=2048, help="target-generated sequences to train on")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--gen-temperature", type=float, default=0.0, help="0: the target's greedy continuation")
    p.add_argument("--anchors", type=int, default=16, help="anchors per sequence per step")
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--layers", type=int, default=3, help="drafter layers")
    p.add_argument("--target-layers", type=int, nargs="+", help="0-based target layers to capture (not the last)")
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="fraction of steps of linear warmup")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument(
        "--stop-at", type=int, help="checkpoint and stop after this step (a time-boxed run; --resume goes on)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    return p


def smoke_defaults(args: argparse.Namespace) -> None:
    """--smoke: sizes that finish in seconds on one CPU core."""
    for name, value in dict(steps=6, batch_size=4, num_sequences=8, prompt_len=8, gen_len=16, anchors=4,
                            block_size=4, layers=1, markov_rank=8, save_every=3).items():  # fmt: skip
        if getattr(args, name) == build_parser().get_default(name):
            setattr(args, name, value)
    args.device = args.device or "cpu"


def load_target(args: argparse.Namespace, device: torch.device):
    if args.smoke:
        torch.manual_seed(args.seed)
        return KimiK3ForCausalLM(get_preset("tiny")).to(device).eval(), None
    from transformers import AutoTokenizer

    target = KimiK3ForCausalLM.from_pretrained(args.target, device=device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=False) if args.prompts else None
    return target, tokenizer


def make_prompts(args, tokenizer, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[N, prompt_len] prompt windows: from the prompt file's tokens, else uniform over the first 256 ids."""
    n, plen = args.num_sequences, args.prompt_len
    if tokenizer is None:
        return torch.randint(0, min(vocab, 256), (n, plen), generator=gen)
    lines = [ln for ln in args.prompts.read_text().splitlines() if ln.strip()]
    ids = [t for ln in lines for t in tokenizer(ln, add_special_tokens=False).input_ids]
    if len(ids) < plen + 1:
        raise SystemExit(f"--prompts {args.prompts}: {len(ids)} tokens, fewer than --prompt-len {plen} + 1")
    starts = torch.randint(0, len(ids) - plen, (n,), generator=gen).tolist()
    return torch.tensor([ids[s : s + plen] for s in starts])


@torch.no_grad()
def generate_sequences(target, prompts: torch.Tensor, args, device) -> torch.Tensor:
    """The target's own continuations of the prompts: [N, prompt_len + gen_len]."""
    out = []
    sample = args.gen_temperature > 0
    for chunk in tqdm(prompts.split(args.batch_size), desc="target generates", unit="batch"):
        seqs = target.generate(
            chunk.to(device),
            max_new_tokens=args.gen_len,
            min_new_tokens=args.gen_len,
            do_sample=sample,
            temperature=args.gen_temperature if sample else None,
            top_p=None,
            top_k=None,
        )
        out.append(seqs.cpu())
    return torch.cat(out)


def build_drafter(args, target, device) -> DSparkDrafter:
    tc = target.config
    layer_ids = args.target_layers or default_target_layer_ids(tc.num_hidden_layers, min(5, tc.num_hidden_layers - 1))
    mask = tc.pad_token_id if tc.pad_token_id is not None else tc.vocab_size - 1
    heads = max(1, tc.hidden_size // 64)
    cfg = DSparkConfig(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        head_dim=tc.hidden_size // heads,
        intermediate_size=tc.intermediate_size,
        target_layer_ids=layer_ids,
        target_num_hidden_layers=tc.num_hidden_layers,
        block_size=args.block_size,
        mask_token_id=mask,
        markov_rank=args.markov_rank,
        rms_norm_eps=tc.rms_norm_eps,
    )
    torch.manual_seed(args.seed + 1)
    return DSparkDrafter(cfg).to(device)


def train_step(drafter, target, capture, seqs, args, gen: torch.Generator, device):
    """One batch: target features and logits, random anchors in the generated part, the DeepSpec loss."""
    seqs = seqs.to(device)
    b, s = seqs.shape
    g = drafter.config.block_size
    with torch.no_grad():
        hidden = target.model(seqs, use_cache=False).last_hidden_state
        feats = capture.pop().view(b, s, -1)
        lo, hi = args.prompt_len - 1, s - g - 1  # anchors whose block labels are all target-generated
        anchors = torch.randint(lo, hi + 1, (b, args.anchors), generator=gen).to(device)
        idx = anchors[..., None] + torch.arange(g, device=device)  # slot k is predicted from position anchor + k
        target_logits = target.lm_head(hidden[torch.arange(b, device=device)[:, None, None], idx])
    out = drafter(seqs, feats, anchors)
    labels = drafter.labels_for(seqs, anchors)
    return dspark_loss(out.logits, out.confidence_logits, labels, target_logits)


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to 10%."""
    warm = max(1, int(args.warmup * args.steps))
    if step < warm:
        return args.lr * (step + 1) / warm
    t = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def save_checkpoint(drafter, optimizer, step: int, ckpt: Path) -> None:
    drafter.save_pretrained(ckpt)
    torch.save(optimizer.state_dict(), ckpt / OPTIMIZER_FILE)
    (ckpt / STATE_FILE).write_text(json.dumps({"step": step}))


def check_out_dir(out: Path) -> None:
    """Refuse to write over a folder that holds some other model."""
    cfg = out / "config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("model_type") != "dspark":
        raise SystemExit(f"--out {out} holds a config.json that is not a DSpark drafter's; choose another folder")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        smoke_defaults(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_out_dir(args.out)
    ckpt = args.out / "checkpoint"
    target, tokenizer = load_target(args, device)
    for p in target.parameters():
        p.requires_grad_(False)

    data_gen = torch.Generator().manual_seed(args.seed)
    prompts = make_prompts(args, tokenizer, target.config.vocab_size, data_gen)
    sequences = generate_sequences(target, prompts, args, device)

    if args.resume:
        if not (ckpt / STATE_FILE).is_file():
            raise SystemExit(f"--resume: {ckpt} holds no checkpoint")
        drafter = DSparkDrafter.from_pretrained(ckpt, device=device)
        start = json.loads((ckpt / STATE_FILE).read_text())["step"]
    else:
        drafter, start = build_drafter(args, target, device), 0
    drafter.bind_target(target)
    drafter.train()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    if args.resume:
        optimizer.load_state_dict(torch.load(ckpt / OPTIMIZER_FILE, map_location=device, weights_only=True))

    capture = TargetFeatureCapture(target, drafter.config.target_layer_ids).attach()
    end = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    bar = tqdm(range(start, end), initial=start, total=args.steps, desc="drafter", unit="step")
    for step in bar:
        step_gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # a resumed run draws the same
        rows = torch.randint(0, sequences.shape[0], (args.batch_size,), generator=step_gen)
        loss = train_step(drafter, target, capture, sequences[rows], args, step_gen, device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        accept = loss.acceptance
        bar.set_postfix(loss=f"{loss.total.item():.3f}", ce=f"{loss.ce.item():.3f}", acc0=f"{accept[0].item():.2f}",
                        tau_est=f"{1 + accept.cumprod(0).sum().item():.2f}")  # fmt: skip
        if (step + 1) % args.save_every == 0 or step + 1 == end:
            save_checkpoint(drafter, optimizer, step + 1, ckpt)
    capture.detach()
    if end < args.steps:
        print(f"stopped at step {end} of {args.steps}; checkpoint in {ckpt} (continue with --resume)")
        return 0
    drafter.save_pretrained(args.out)
    print(f"wrote the drafter to {args.out} (step {args.steps}; checkpoint in {ckpt})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
