"""One generation under tensor and Helix context parallelism, shared by `scripts/generate.py` and
`kimi-helix generate --tp T --cp C` (both launched by torchrun, one process per rank)."""

from __future__ import annotations

from pathlib import Path


def generate_parallel(
    model: str | Path,
    prompt: str,
    *,
    tp: int,
    cp: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    dtype=None,
    page_size: int = 64,
    timeout_s: float = 60.0,
):
    """Continue `prompt` on every rank of a torchrun launch; returns `(text, metrics)` on rank 0 and
    `(None, metrics)` elsewhere. Every rank reads only its own slices of the checkpoint; a failed rank makes the
    others raise `RankFailureError` naming it within `timeout_s`."""
    from kimi_helix.engine.llm import LLM
    from kimi_helix.engine.sampling import SamplingParams
    from kimi_helix.parallel.distributed import run_guarded

    llm = LLM(  # joins the process group of the torchrun launch when tp * cp > 1
        model,
        dtype=dtype,
        page_size=page_size,
        max_model_len=len(prompt.encode()) + max_new_tokens + 8,
        max_num_seqs=1,
        tensor_parallel_size=tp,
        context_parallel_size=cp,
        dist_timeout_s=timeout_s,
    )
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed)
    ctx = llm.comm.ctx if llm.comm is not None else None
    run = lambda: llm.generate([prompt], params, use_tqdm=False)  # noqa: E731
    outputs = run_guarded(run, ctx) if ctx is not None else run()
    return (outputs[0].text if outputs else None), llm.metrics
