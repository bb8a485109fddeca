"""Multi-process test support: spawn gloo ranks, a tiny config every tested tp x cp splits, and a step driver that
runs prefill, decode and verify steps on any cache with the engine's layer calls."""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

from kimi_helix.modeling.batch import ForwardBatch, Phase
from kimi_helix.modeling.config import KimiK3Config

PAGE_SIZE = 4


def parallel_test_config(**overrides) -> KimiK3Config:
    """12 MLA heads, 12 KDA heads, 12 experts, vocab 384: divisible by every tp * cp in {1, 2, 3, 4}; two MLA layers
    with RoPE (global positions matter), q-LoRA and the output gate."""
    fields = dict(
        vocab_size=384, hidden_size=48, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=12, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, mla_use_nope=False, mla_use_output_gate=True,
        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 12, "head_dim": 8,
                            "short_conv_kernel_size": 4},
        num_experts=12, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    fields.update(overrides)
    return KimiK3Config(**fields)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, fn, args, queue):
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # the parent reports every rank's failure; the exit code shows it too
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def start(fn, world: int, *args) -> tuple[list, object]:
    """Start `fn(rank, world, *args)` in `world` fresh processes; returns (processes, queue of (rank, status,
    value) reports)."""
    ctx = mp.get_context("forkserver")
    # The fork server is a fresh process (no inherited threads or process groups) that imports these once; every
    # rank forks from it instead of re-importing torch and transformers (tens of seconds on a loaded CPU).
    ctx.set_forkserver_preload(["torch", "kimi_helix.parallel.helix", "kimi_helix.parallel.tp", __name__])
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, queue


def collect(procs, queue, results: dict, deadline: float) -> None:
    """Add reports to `results` until every rank reported or exited, or `deadline` (monotonic) passes."""
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=0.2)
            results[rank] = (status, value)
        except queue_module.Empty:
            if not any(p.is_alive() for p in procs) and queue.empty():
                break


def stop(procs) -> None:
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def spawn(fn, world: int, *args, timeout_s: float = 120.0) -> dict[int, tuple[str, object]]:
    """Run `fn(rank, world, *args)` in `world` fresh processes; returns {rank: ("ok", result) | ("error", text)}.
    Ranks that exit without reporting are missing from the result."""
    procs, queue = start(fn, world, *args)
    results: dict[int, tuple[str, object]] = {}
    collect(procs, queue, results, time.monotonic() + timeout_s)  # a killed rank never reports
    stop(procs)
    return results


def check_all_ok(results: dict, world: int) -> list:
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not errors and len(results) == world, f"ranks failed: {errors or 'some rank never reported'}"
    return [results[r][1] for r in range(world)]


def forward_logits(model, view, batch: ForwardBatch, ids: list[int], rows: torch.Tensor) -> torch.Tensor:
    """One forward pass of packed `ids` through `view`; fp32 logits at `rows`."""
    with torch.no_grad():
        x = model.model.embed_tokens(torch.tensor(ids, dtype=torch.long))
        hidden = model.model.forward_packed(x, batch, view)
        view.commit(batch)
        return model.lm_head(hidden[rows]).float()


def drive(model, cache, prompts, decode_steps: int, verify_drafts=None, comm=None):
    """Prefill every prompt in one step, greedy-decode `decode_steps` steps, then (optionally) one verify step
    feeding each sequence's last token plus its drafts. Returns (logits per step, greedy tokens, bytes sent per
    step by `comm`'s collectives, if given)."""
    reserve = [len(p) + decode_steps + 1 + max((len(d) for d in verify_drafts or [[]]), default=0) for p in prompts]
    for i, n in enumerate(reserve):
        cache.ledger.admit(i, n)
    seqs = [list(p) for p in prompts]
    lens = [0] * len(prompts)
    out, tokens, sent = [], [], []
    for step in range(decode_steps + 1 + (verify_drafts is not None)):
        if step == 0:
            new = [list(p) for p in prompts]
        elif step <= decode_steps:
            new = [[s[-1]] for s in seqs]
        else:
            new = [[s[-1], *d] for s, d in zip(seqs, verify_drafts)]
        phase = Phase.PREFILL if step == 0 else Phase.DECODE if step <= decode_steps else Phase.VERIFY
        batch = ForwardBatch.build([len(n) for n in new], lens, "cpu", [phase] * len(new))
        last = batch.cu_seqlens[1:].long() - 1
        rows = torch.arange(batch.num_tokens) if step > decode_steps else last
        if comm is not None:
            comm.reset_counters()
        logits = forward_logits(model, cache.view(list(range(len(prompts)))), batch, [t for n in new for t in n], rows)
        out.append(logits)
        sent.append(dict(comm.bytes_sent) if comm is not None else {})
        lens = batch.total_lens()
        if step <= decode_steps:
            chosen = logits.argmax(-1).tolist()
            tokens.append(chosen)
            for s, t in zip(seqs, chosen):
                s.append(t)
    return out, tokens, sent
