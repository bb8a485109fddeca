"""One generation under tensor and Helix context parallelism, shared by `scripts/generate.py` and
`kimi-helix generate --tp T --cp C` (both launched by torchrun, one process per rank)."""

from __future__ import annotations

import argparse


def generate_parallel(args: argparse.Namespace, on_logits=None):
    """Continue `args.prompt` on every rank of a torchrun launch; returns `(text, metrics)` on rank 0 and
    `(None, metrics)` elsewhere.

    `args` is the parsed command line both launchers share: `model` (a checkpoint folder), `prompt`, `tp`, `cp`,
    `max_new_tokens`, `temperature`, `seed`, `dtype` (a torch dtype name or None: the checkpoint's), `page_size`
    and, optionally, `timeout` (seconds, default 60). `on_logits(logits)`, if given, sees each step's fp32 logits
    [R, V] (R: the rows the step samples) on every rank. Every rank reads only its own slices of the checkpoint; a
    failed rank makes the others raise `RankFailureError` naming it within the timeout.
    """
    import torch

    from kimi_helix.engine.llm import LLM
    from kimi_helix.engine.sampling import SamplingParams
    from kimi_helix.parallel.distributed import run_guarded

    llm = LLM(  # joins the process group of the torchrun launch when tp * cp > 1
        args.model,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        page_size=args.page_size,
        max_model_len=len(args.prompt.encode()) + args.max_new_tokens + 8,
        max_num_seqs=1,
        tensor_parallel_size=args.tp,
        context_parallel_size=args.cp,
        dist_timeout_s=getattr(args, "timeout", 60.0),
    )
    if on_logits is not None:
        run = llm.runner.run

        def observed(step):
            out = run(step)
            on_logits(out.logits)
            return out

        llm.runner.run = observed
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    ctx = llm.comm.ctx if llm.comm is not None else None
    generate = lambda: llm.generate([args.prompt], params, use_tqdm=False)  # noqa: E731
    outputs = run_guarded(generate, ctx) if ctx is not None else generate()
    return (outputs[0].text if outputs else None), llm.metrics
