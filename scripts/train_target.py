"""Train the demo model (`kimi_helix/assets/demo_recipe.py`) on the token arrays of `scripts/prepare_corpus.py`.

The model trains through its own forward (`KimiK3ForCausalLM(input_ids, labels=...)`) with every op on its torch
reference (`KIMI_HELIX_KERNEL_BACKEND=torch`): the Triton kernels are forward-only, the references have autograd.
AdamW, linear warmup then cosine decay, bf16 autocast on CUDA, gradient clipping. Batches are drawn from a
generator seeded by (seed, step), so a resumed run sees the same data as an uninterrupted one.

Writes into --out: `loss.jsonl` (one record per logged step, plus eval and repro records), `model/` (bf16
`save_pretrained` + tokenizer) and `summary.json`; the resumable checkpoint goes to --ckpt-dir (default --out).

    python scripts/train_target.py --out out/demo --max-minutes 7 --check-repro    # the GPU run
    python scripts/train_target.py --smoke --out /tmp/smoke                        # a few CPU steps (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kimi_helix.assets import DEMO_DIR  # noqa: E402
from kimi_helix.assets.demo_recipe import bits_per_byte, demo_config, token_byte_lengths  # noqa: E402
from kimi_helix.modeling.model import KimiK3ForCausalLM  # noqa: E402

CHECKPOINT = "checkpoint.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CALIB_SKIP = 5
SMOKE = {"device": "cpu", "steps": 3, "batch_size": 2, "seq_len": 64, "warmup": 1, "eval_windows": 2, "log_every": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train the kimi-helix demo model.")
    ap.add_argument("--data", type=Path, default=REPO / "data" / "demo", help="folder of train.npy / heldout.npy")
    ap.add_argument("--tokenizer", type=Path, default=DEMO_DIR, help="folder of the tokenizer files")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ckpt-dir", type=Path, default=None, help="where checkpoint.pt goes (default: --out)")
    ap.add_argument("--steps", type=int, default=0, help="total steps; 0: as many as --max-minutes allows")
    ap.add_argument("--max-minutes", type=float, default=6.5, help="training time budget (the run stops there)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--eval-windows", type=int, default=128, help="held-out windows for the final bits per byte")
    ap.add_argument("--calib-steps", type=int, default=20, help="steps timed to size the run when --steps is 0")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt-dir/checkpoint.pt")
    ap.add_argument("--check-repro", action="store_true", help="rerun the first 100 steps and compare the loss")
    ap.add_argument("--smoke", action="store_true", help=f"a few tiny CPU steps (CI): defaults {SMOKE}")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(**SMOKE)  # explicit options still win, e.g. --smoke --steps 4
    args = ap.parse_args(argv)
    args.ckpt_dir = args.ckpt_dir or args.out
    return args


class TokenStream:
    """Random windows of a uint16 token array; window starts come from a generator seeded by (seed, step)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, device: torch.device):
        if tokens.size <= seq_len + 1:
            raise ValueError(f"the token array has {tokens.size} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.offsets = torch.arange(seq_len, device=device)

    def batch(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len] token ids of `step` (the model's loss shifts the labels itself)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=gen)
        return self.tokens[starts.to(self.tokens.device)[:, None] + self.offsets]


def build_model(config, seed: int, device: torch.device) -> KimiK3ForCausalLM:
    torch.manual_seed(seed)
    return KimiK3ForCausalLM(config).to(device)


def build_optimizer(model, args) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with weight decay on matrices only; warmup then cosine to `min_lr_ratio` over `args.steps`."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        total = max(args.steps, args.warmup + 1)  # args.steps may be fixed only after the timed first steps
        progress = min(1.0, (step - args.warmup) / (total - args.warmup))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_step(model, opt, sched, ids: torch.Tensor, args) -> float:
    """One optimiser step on ids [B, T]; returns the loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def save_checkpoint(path: Path, model, opt, sched, step: int, args, losses: list[float]) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    torch.save({**state, "step": step, "steps": args.steps, "losses": losses}, tmp)
    tmp.replace(path)


def run_training(model, opt, sched, stream: TokenStream, args, log, start_step: int, losses: list[float]) -> int:
    """Train from `start_step` until `args.steps` or the time budget; returns the number of steps done."""
    budget_s, started = args.max_minutes * 60, time.perf_counter()
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(total=args.steps or None, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
    step, window_t, window_steps = start_step, time.perf_counter(), 0
    while args.steps == 0 or step < args.steps:
        loss = train_step(model, opt, sched, stream.batch(step), args)
        losses.append(loss)
        step += 1
        window_steps += 1
        bar.update()
        if args.steps == 0 and step == start_step + CALIB_SKIP:
            calib_t = time.perf_counter()  # the first steps include CUDA start-up: time the ones after
        if args.steps == 0 and step == start_step + CALIB_SKIP + args.calib_steps:
            per_step = (time.perf_counter() - calib_t) / args.calib_steps
            left_s = budget_s - (time.perf_counter() - started)
            # 5% headroom, so that the cosine schedule ends before the time budget cuts the run
            args.steps = max(args.warmup + 1, step + int(0.95 * left_s / per_step))
            bar.total = args.steps
            log({"event": "sized", "step": step, "s_per_step": per_step, "steps": args.steps})
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            tok_s = window_steps * tokens_per_step / (now - window_t)
            window_t, window_steps = now, 0
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
            log(
                {
                    "step": step,
                    "loss": loss,
                    "lr": sched.get_last_lr()[0],
                    "tok_per_s": tok_s,
                    "elapsed_s": now - started,
                }
            )
        if step % args.ckpt_every == 0:
            save_checkpoint(args.ckpt_dir / CHECKPOINT, model, opt, sched, step, args, losses)
        if time.perf_counter() - started > budget_s:
            log({"event": "time_budget", "step": step, "minutes": args.max_minutes})
            break
    bar.close()
    return step


def check_repro(config, stream: TokenStream, args, losses: list[float], device) -> dict:
    """Rerun the first min(100, steps) steps from the same seed; compare the loss there with the main run's."""
    n = min(100, len(losses))
    model = build_model(config, args.seed, device)
    opt, sched = build_optimizer(model, args)
    again = [train_step(model, opt, sched, stream.batch(step), args) for step in tqdm(range(n), desc="repro")]
    return {
        "event": "repro",
        "step": n,
        "loss": losses[n - 1],
        "rerun_loss": again[-1],
        "abs_diff": abs(again[-1] - losses[n - 1]),
    }


def save_final(model, args) -> Path:
    """bf16 `save_pretrained` + tokenizer files into out/model."""
    out = args.out / "model"
    bf16 = copy.deepcopy(model).cpu()
    keep_fp32 = KimiK3ForCausalLM._keep_in_fp32_modules_strict  # routing and gate parameters stay fp32
    for name, param in bf16.named_parameters():
        if not any(key in name for key in keep_fp32):
            param.data = param.data.to(torch.bfloat16)
    bf16.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(args.tokenizer / name, out / name)
    return out


@contextlib.contextmanager
def training_mode():
    """Torch references for every op (the only ones with a backward) and deterministic algorithms; restored after.

    Entered before anything touches CUDA, so cuBLAS sees its deterministic workspace setting."""
    env = {"KIMI_HELIX_KERNEL_BACKEND": "torch", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    saved_env = {key: os.environ.get(key) for key in env}
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.update(env)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with training_mode():
        return train(args)


def train(args: argparse.Namespace) -> dict:
    """The whole run: train, save, evaluate, optionally check reproducibility; returns the summary."""
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=False)
    config = demo_config(tokenizer)
    stream = TokenStream(np.load(args.data / "train.npy"), args.seq_len, args.batch_size, args.seed, device)
    model = build_model(config, args.seed, device)
    opt, sched = build_optimizer(model, args)
    start_step, losses = 0, []
    ckpt = args.ckpt_dir / CHECKPOINT
    if args.resume:
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_step, losses = state["step"], state["losses"]
        args.steps = args.steps or state["steps"]  # an explicit --steps extends (or shortens) the schedule

    log_file = (args.out / "loss.jsonl").open("a" if args.resume else "w")

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    log(
        {
            "event": "start",
            "params": n_params,
            "device": str(device),
            "resume_step": start_step,
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
    )
    t0 = time.perf_counter()
    step = run_training(model, opt, sched, stream, args, log, start_step, losses)
    train_s = time.perf_counter() - t0
    save_checkpoint(ckpt, model, opt, sched, step, args, losses)
    final_dir = save_final(model, args)

    model.eval()
    heldout = torch.from_numpy(np.load(args.data / "heldout.npy").astype(np.int64))
    lengths = token_byte_lengths(tokenizer, config.vocab_size)
    bpb = bits_per_byte(model, heldout, lengths, args.seq_len, args.batch_size, args.eval_windows)
    log({"event": "eval", "step": step, "heldout_bpb": bpb})
    summary = {
        "steps": step,
        "train_seconds": train_s,
        "tokens": step * args.batch_size * args.seq_len,
        "params": n_params,
        "heldout_bpb": bpb,
        "final_loss": losses[-1],
        "model_dir": str(final_dir),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if args.check_repro:
        model.train()
        result = check_repro(config, stream, args, losses, device)
        log(result)
        summary["repro_abs_diff"] = result["abs_diff"]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log_file.close()
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
