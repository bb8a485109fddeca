"""Generate with tensor and Helix context parallelism, one process per rank, launched by torchrun:

    torchrun --nproc-per-node 4 scripts/generate.py --model DIR --tp 2 --cp 2 --prompt "Hello"

Every rank loads only its own slices of the checkpoint; rank 0 prints the continuation (the same text as
`kimi-helix generate` on one process), with --stats the bytes each step sent from rank 0, and with --save-logits
each step's logits. NCCL on CUDA, gloo on CPU. If a rank fails, the others stop within --timeout seconds naming it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Control characters are escaped as `kimi-helix generate` does, so the two outputs compare byte for byte.
_ESCAPE_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}
DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="a checkpoint folder with its tokenizer")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of MLA attention")
    p.add_argument("--cp", type=int, default=1, help="Helix context-parallel size (MLA pages split cp ways)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) decodes greedily")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, help="default: the checkpoint's")
    p.add_argument("--page-size", type=int, default=64, help="tokens per cache page (the Helix ownership unit)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits for a peer before aborting")
    p.add_argument("--stats", action="store_true", help="print the bytes rank 0 sent per step")
    p.add_argument(
        "--save-logits", type=Path, metavar="FILE", help="rank 0 saves each step's fp32 logits [R, V] (torch.save)"
    )
    args = p.parse_args(argv)
    for name in ("tp", "cp", "max_new_tokens", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kimi_helix.parallel.launch import generate_parallel

    logits: list = []
    text, metrics = generate_parallel(args, on_logits=(lambda x: logits.append(x.cpu())) if args.save_logits else None)
    if text is not None:  # rank 0
        print(text.translate(_ESCAPE_CONTROLS))
        if args.stats:
            for m in metrics:
                print(f"step {m.step}: {m.scheduled_tokens} tokens, {m.bytes_sent} bytes sent", file=sys.stderr)
        if args.save_logits:
            torch.save(logits, args.save_logits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
