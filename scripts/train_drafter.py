"""Distil a DSpark drafter for a kimi-helix target with DeepSpec's loss (0.1 CE + 0.9 L1 + 1.0 BCE, exp(-k/4)).

    python scripts/train_drafter.py --out DRAFT_DIR --max-minutes 6     # GPU: the shipped demo model's drafter
    python scripts/train_drafter.py --target DIR --prompts prompts.txt --out DRAFT_DIR
    python scripts/train_drafter.py --out DRAFT_DIR --resume                # continue where it stopped
    python scripts/train_drafter.py --smoke --out /tmp/draft                # tiny random target, CPU, seconds

The target regenerates the training text itself: prompts of `--prompt-len` tokens are continued by the target for
`--gen-len` tokens (greedy, or sampled at `--gen-temperature`), once, before training. The prompts are windows of
`--prompts` (tokenized with the target folder's tokenizer); without it, for a target with a tokenizer, lines of the
train split of the demo corpus (`scripts/demo_prompts.py`: this interpreter's standard library); else random tokens.

Each step draws a batch of those sequences, runs the frozen target with forward hooks on the captured layers,
samples `--anchors` anchors per sequence in the generated part, and trains the drafter on the teacher-forced
blocks (fp32 weights, autocast to a bf16 / fp16 target's dtype). The embedding and LM head are the target's,
frozen. With `--steps 0` (the default) the run is sized from the timed first steps to end inside `--max-minutes`
(counted from the start, generation included), and it stops at that budget in any case.

Every `--save-every` steps (and at the end) `OUT/checkpoint/` (or `--ckpt-dir`) holds the drafter, the optimizer
and the step, so `--resume` continues exactly; `OUT/` holds the finished drafter in the target's dtype (config.json and
model.safetensors, without the shared embedding and head). The last line printed is the greedy tau at
`--eval-k` on held-out prompts (`heldout_tau`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # demo_prompts, also when loaded by path

from kimi_helix.assets import demo_model_dir
from kimi_helix.kernels.backends import BackendChoice
from kimi_helix.modeling import KimiK3ForCausalLM
from kimi_helix.presets import get_preset
from kimi_helix.speculative.dspark import DSparkConfig, DSparkDrafter, TargetFeatureCapture, default_target_layer_ids
from kimi_helix.speculative.dspark.loss import dspark_loss

STATE_FILE = "train_state.json"
OPTIMIZER_FILE = "optimizer.pt"
CALIB_STEPS = (5, 25)  # steps [5, 25) are timed to size a --steps 0 run (inside the warm-up, so lr is known)
EVAL_RESERVE_S = 30.0  # of --max-minutes kept for the final save and the held-out evaluation


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--target", type=Path, metavar="DIR", help="the target checkpoint folder (default: the demo model)"
    )
    src.add_argument("--smoke", action="store_true", help="a tiny random target on the CPU, a few quick steps")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the drafter is written")
    p.add_argument("--ckpt-dir", type=Path, metavar="DIR", help="the resumable checkpoint (default: OUT/checkpoint)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    p.add_argument("--prompts", type=Path, help="a text file of prompts (default: the demo corpus' train split)")
    p.add_argument("--steps", type=int, default=0, help="0: as many as --max-minutes allows")
    p.add_argument("--max-minutes", type=float, default=6.0, help="time budget of the whole run (it stops there)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--gen-batch-size", type=int, default=512, help="sequences the target continues at once")
    p.add_argument("--num-sequences", type=int, default=4096, help="target-generated sequences to train on")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--gen-temperature", type=float, default=0.0, help="0: the target's greedy continuation")
    p.add_argument("--anchors", type=int, default=16, help="anchors per sequence per step")
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--intermediate-size", type=int, help="drafter MLP width (default: the target's)")
    p.add_argument("--target-layers", type=int, nargs="+", help="0-based target layers to capture (not the last)")
    p.add_argument("--markov-rank", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100, help="steps of linear warm-up")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts for the final tau (0: none)")
    p.add_argument("--eval-k", type=int, default=5, help="drafts per round for the final tau")
    p.add_argument(
        "--stop-at", type=int, help="checkpoint and stop after this step (a time-boxed run; --resume goes on)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    return p


# --smoke: sizes that finish in seconds on one CPU core (options given explicitly still win).
SMOKE = dict(steps=6, batch_size=4, gen_batch_size=4, num_sequences=8, prompt_len=8, gen_len=16, anchors=4,
             block_size=4, layers=1, markov_rank=8, warmup=2, save_every=3, eval_prompts=2, eval_k=3,
             device="cpu")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**SMOKE)
    return parser.parse_args(argv)


def load_target(args: argparse.Namespace, device: torch.device):
    """The frozen target (the demo model unless --target / --smoke) and its folder's tokenizer (None for --smoke)."""
    if args.smoke:
        torch.manual_seed(args.seed)
        return KimiK3ForCausalLM(get_preset("tiny")).to(device).eval(), None
    from transformers import AutoTokenizer

    folder = args.target or demo_model_dir()
    target = KimiK3ForCausalLM.from_pretrained(folder, device=device).eval()
    has_tokenizer = (Path(folder) / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False) if has_tokenizer else None
    if tokenizer is None and args.prompts:
        raise SystemExit(f"--prompts needs the target's tokenizer; {folder} has no tokenizer_config.json")
    return target, tokenizer


def make_prompts(args, tokenizer, vocab: int, split: str, num: int, seed: int) -> torch.Tensor:
    """[num, prompt_len] prompts of `split` ("train" or "heldout"): windows of the --prompts file's tokens (its
    last tenth held out), else lines of the demo corpus' split, else (no tokenizer) uniform over the first 256 ids."""
    plen, gen = args.prompt_len, torch.Generator().manual_seed(seed)
    if tokenizer is None:
        return torch.randint(0, min(vocab, 256), (num, plen), generator=gen)
    if args.prompts is None:
        from demo_prompts import corpus_prompts

        return torch.tensor(corpus_prompts(tokenizer, split, num, plen, seed))
    lines = [ln for ln in args.prompts.read_text().splitlines() if ln.strip()]
    ids = [t for ln in lines for t in tokenizer(ln, add_special_tokens=False).input_ids]
    cut = len(ids) * 9 // 10
    ids = ids[:cut] if split == "train" else ids[cut:]
    if len(ids) < plen + 1:
        raise SystemExit(f"--prompts {args.prompts}: {len(ids)} {split} tokens, fewer than --prompt-len {plen} + 1")
    starts = torch.randint(0, len(ids) - plen, (num,), generator=gen).tolist()
    return torch.tensor([ids[s : s + plen] for s in starts])


@torch.no_grad()
def generate_sequences(target, prompts: torch.Tensor, args, device, desc: str) -> torch.Tensor:
    """The target's own continuations of the prompts: [N, prompt_len + gen_len]."""
    out = []
    sample = args.gen_temperature > 0
    for chunk in tqdm(prompts.split(args.gen_batch_size), desc=desc, unit="batch"):
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
        intermediate_size=args.intermediate_size or tc.intermediate_size,
        target_layer_ids=layer_ids,
        target_num_hidden_layers=tc.num_hidden_layers,
        block_size=args.block_size,
        mask_token_id=mask,
        markov_rank=args.markov_rank,
        rms_norm_eps=tc.rms_norm_eps,
    )
    torch.manual_seed(args.seed + 1)
    return DSparkDrafter(cfg).to(device)


@contextlib.contextmanager
def reference_kernels(drafter: DSparkDrafter):
    """Run the drafter's norms, SwiGLU and rotary on their torch references inside the block (each follows its
    module's `backends`).

    On the GPU those ops dispatch to Triton kernels, which are forward-only: gradients would stop at each of them
    and only the heads past the final norm would train. The target keeps its kernels (it runs without grad)."""
    saved = [(m, m.backends) for m in drafter.modules() if isinstance(getattr(m, "backends", None), BackendChoice)]
    for m, choice in saved:
        m.backends = BackendChoice(attention=choice.attention, kernels="torch")
    try:
        yield drafter
    finally:
        for m, choice in saved:
            m.backends = choice


def autocast(target, device: torch.device):
    """Autocast to a bf16 / fp16 target's dtype (the drafter keeps fp32 weights); nothing for an fp32 target."""
    if target.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=target.dtype)


@torch.no_grad()
def target_pass(target, capture, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs [B, S] -> the captured features [B, S, m*d] and the final hidden states [B, S, d]."""
    hidden = target.model(seqs, use_cache=False).last_hidden_state
    return capture.pop().view(*seqs.shape, -1), hidden


def train_step(drafter, target, capture, seqs, args, gen: torch.Generator, device):
    """One batch: target features and logits, random anchors in the generated part, the DeepSpec loss."""
    seqs = seqs.to(device)
    b, s = seqs.shape
    g = drafter.config.block_size
    feats, hidden = target_pass(target, capture, seqs)
    lo, hi = args.prompt_len - 1, s - g - 1  # anchors whose block labels are all target-generated
    anchors = torch.randint(lo, hi + 1, (b, args.anchors), generator=gen).to(device)
    idx = anchors[..., None] + torch.arange(g, device=device)  # slot k is predicted from position anchor + k
    with torch.no_grad():
        target_logits = target.lm_head(hidden[torch.arange(b, device=device)[:, None, None], idx])
    with autocast(target, device):
        out = drafter(seqs, feats, anchors)
    labels = drafter.labels_for(seqs, anchors)
    return dspark_loss(out.logits, out.confidence_logits, labels, target_logits)


@torch.no_grad()
def heldout_tau(drafter, target, capture, seqs: torch.Tensor, prompt_len: int, k: int, device) -> tuple[float, list]:
    """Greedy tau at k drafts per round on target-generated sequences [N, S], and acceptance by position.

    Teacher-forced drafts at every anchor are exactly greedy drafting's while the drafts match (the Markov head
    then reads the true previous token), so each sequence replays the rounds greedy speculative decoding makes
    from the end of its prompt: accept the drafts that match the target's tokens, emit one more, move on."""
    g = drafter.config.block_size
    totals = [0, 0, [0] * k]  # rounds, tokens emitted, rounds whose draft j was accepted
    for seq in seqs.split(4):
        seq = seq.to(device)
        feats, _ = target_pass(target, capture, seq)
        anchors = torch.arange(prompt_len - 1, seq.shape[1] - g, device=device).expand(seq.shape[0], -1)
        with autocast(target, device):
            logits = drafter(seq, feats, anchors).logits[..., :k, :]
        match = (logits.argmax(-1) == drafter.labels_for(seq, anchors)[..., :k]).int()
        for leading in match.cumprod(-1).sum(-1).tolist():  # per anchor: how many leading drafts match
            rounds, emitted, accepted_at = replay_rounds(leading, k)
            totals = [totals[0] + rounds, totals[1] + emitted, [a + b for a, b in zip(totals[2], accepted_at)]]
    rounds = max(totals[0], 1)
    return totals[1] / rounds, [a / rounds for a in totals[2]]


def replay_rounds(leading: list[int], k: int) -> tuple[int, int, list[int]]:
    """Greedy rounds over one sequence from its first anchor: `leading[a]` drafts match at anchor a, so a round
    there emits leading[a] + 1 tokens and the next anchor is a + leading[a] + 1. Returns (rounds, tokens emitted,
    [rounds whose draft j was accepted for j < k])."""
    rounds = emitted = a = 0
    accepted_at = [0] * k
    while a < len(leading):
        n = min(leading[a], k)
        rounds, emitted = rounds + 1, emitted + n + 1
        for j in range(n):
            accepted_at[j] += 1
        a += n + 1
    return rounds, emitted, accepted_at


def lr_at(step: int, args) -> float:
    """Linear warm-up over --warmup steps, then cosine decay to 10% at --steps."""
    warm = max(1, min(args.warmup, args.steps or args.warmup))
    if step < warm:
        return args.lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, args.steps - warm))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def save_checkpoint(drafter, optimizer, step: int, steps: int, ckpt: Path) -> None:
    drafter.save_pretrained(ckpt)
    torch.save(optimizer.state_dict(), ckpt / OPTIMIZER_FILE)
    (ckpt / STATE_FILE).write_text(json.dumps({"step": step, "steps": steps}))


def check_out_dir(out: Path) -> None:
    """Refuse to write over a folder that holds some other model."""
    cfg = out / "config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("model_type") != "dspark":
        raise SystemExit(f"--out {out} holds a config.json that is not a DSpark drafter's; choose another folder")


def start_drafter(args, target, ckpt: Path, device):
    """(drafter, optimizer, first step): fresh, or the checkpoint's with --resume (its --steps too)."""
    if args.resume:
        if not (ckpt / STATE_FILE).is_file():
            raise SystemExit(f"--resume: {ckpt} holds no checkpoint")
        state = json.loads((ckpt / STATE_FILE).read_text())
        drafter, start = DSparkDrafter.from_pretrained(ckpt, device=device), state["step"]
        args.steps = state.get("steps") or args.steps
    else:
        drafter, start = build_drafter(args, target, device), 0
    drafter.bind_target(target)
    drafter.train()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    if args.resume:
        optimizer.load_state_dict(torch.load(ckpt / OPTIMIZER_FILE, map_location=device, weights_only=True))
    return drafter, optimizer, start


def train(args, drafter, optimizer, target, capture, sequences, start: int, deadline: float, ckpt: Path, device):
    """The training loop from step `start`; returns the step it stopped after. A --steps 0 run is sized from
    the timed steps CALIB_STEPS to end EVAL_RESERVE_S before `deadline`; every run stops at `deadline` (after
    one step at least)."""
    end = args.steps if args.stop_at is None else min(args.stop_at, args.steps or args.stop_at)
    bar = tqdm(initial=start, total=args.steps or None, desc="drafter", unit="step")
    step, clock = start, None
    while step < (end or math.inf) and (step == start or time.perf_counter() < deadline):
        step_gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # a resumed run draws the same
        rows = torch.randint(0, sequences.shape[0], (args.batch_size,), generator=step_gen)
        loss = train_step(drafter, target, capture, sequences[rows], args, step_gen, device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        step += 1
        accept = loss.acceptance
        bar.update()
        bar.set_postfix(loss=f"{loss.total.item():.3f}", ce=f"{loss.ce.item():.3f}", acc0=f"{accept[0].item():.2f}",
                        tau_est=f"{1 + accept.cumprod(0).sum().item():.2f}")  # fmt: skip
        if not args.steps and step - start == CALIB_STEPS[0]:
            clock = time.perf_counter()
        if not args.steps and step - start == CALIB_STEPS[1]:
            per_step = (time.perf_counter() - clock) / (CALIB_STEPS[1] - CALIB_STEPS[0])
            args.steps = step + max(1, int((deadline - EVAL_RESERVE_S - time.perf_counter()) / per_step))
            end = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
            bar.total = args.steps
            bar.refresh()
        if step % args.save_every == 0 or step == end:
            save_checkpoint(drafter, optimizer, step, args.steps, ckpt)
    bar.close()
    if step != end:  # stopped by the time budget
        args.steps = args.steps or step
        save_checkpoint(drafter, optimizer, step, args.steps, ckpt)
    return step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.perf_counter() + 60 * args.max_minutes
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_out_dir(args.out)
    ckpt = args.ckpt_dir or args.out / "checkpoint"
    target, tokenizer = load_target(args, device)
    for p in target.parameters():
        p.requires_grad_(False)

    vocab = target.config.vocab_size
    prompts = make_prompts(args, tokenizer, vocab, "train", args.num_sequences, args.seed)
    sequences = generate_sequences(target, prompts, args, device, "target generates")
    drafter, optimizer, start = start_drafter(args, target, ckpt, device)
    capture = TargetFeatureCapture(target, drafter.config.target_layer_ids).attach()
    with reference_kernels(drafter):
        step = train(args, drafter, optimizer, target, capture, sequences, start, deadline, ckpt, device)
    if args.stop_at is not None and step == args.stop_at < args.steps:
        capture.detach()
        print(f"stopped at step {step} of {args.steps}; checkpoint in {ckpt} (continue with --resume)")
        return 0
    drafter.to(target.dtype).eval().save_pretrained(args.out)
    size = (args.out / "model.safetensors").stat().st_size
    budget = " (stopped by --max-minutes)" if step < args.steps else ""
    print(f"wrote the drafter to {args.out}: step {step} of {args.steps}{budget}, {size / 2**20:.2f} MiB")
    if args.eval_prompts and args.eval_k <= drafter.config.block_size:
        held = make_prompts(args, tokenizer, vocab, "heldout", args.eval_prompts, args.seed + 1)
        held = generate_sequences(target, held, args, device, "target continues held-out prompts")
        tau, by_position = heldout_tau(drafter, target, capture, held, args.prompt_len, args.eval_k, device)
        accept = " ".join(f"{a:.2f}" for a in by_position)
        print(f"held-out greedy tau at k={args.eval_k}: {tau:.2f} (acceptance by position {accept})")
    capture.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
