"""The Helix benchmark's CPU smoke run on 2 gloo processes: a row per layout, context, batch and phase with the
fields the issue asks for, bytes per rank equal to docs/helix.md's formula and constant in the context."""

from __future__ import annotations

import json

import torch

from tests.parallel.harness import check_all_ok, spawn

from .conftest import load_script

SMOKE = ["--smoke", "--contexts", "8,24", "--batches", "2", "--steps", "1", "--warmup", "1"]


def _bench_rank(rank, world, out):
    return load_script("bench_helix").main([*SMOKE, "--out", out])


def test_two_rank_smoke_run(tmp_path):
    out = tmp_path / "helix.jsonl"
    out.write_text(json.dumps(dict(tp=1, cp=1, context=24, batch=2, phase="decode", ms_per_step=5.0, gpu="cpu",
                                   preset="tiny", dtype="float32", layers=4)) + "\n")  # fmt: skip
    assert check_all_ok(spawn(_bench_rank, 2, str(out)), 2) == [0, 0]
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    cases = [(r["tp"], r["cp"], r["context"], r["batch"], r["phase"]) for r in rows]
    assert cases == [(tp, cp, c, 2, p) for tp, cp in [(2, 1), (1, 2)] for c in (8, 24) for p in ("decode", "verify")]
    for r in rows:
        assert {"gpu", "date", "commit", "ms_per_step", "a2a_ms", "bytes_per_rank"} <= set(r)
        assert r["ms_per_step"] > 0 and r["bytes_per_rank"] == r["bytes_formula"] > 0, r
        assert (r["a2a_bytes"] > 0) == (r["cp"] > 1) and (r["a2a_ms"] > 0) == (r["cp"] > 1), r
    by_context = {}
    for r in rows:
        by_context.setdefault((r["tp"], r["cp"], r["phase"]), set()).add(r["bytes_per_rank"])
    assert all(len(b) == 1 for b in by_context.values()), by_context  # bytes per step do not grow with context
    speedup = [r for r in rows if r["context"] == 24 and r["phase"] == "decode"]
    assert all(r["speedup_vs_cp1"] == round(5.0 / r["ms_per_step"], 3) for r in speedup)  # the earlier baseline row


def test_cache_need_is_what_the_engine_allocates():
    bench = load_script("bench_helix")
    from bench_e2e import random_model, truncated_config

    from kimi_helix.engine import LLM
    from kimi_helix.parallel.ownership import Ownership

    config = truncated_config("tiny", None)
    llm = LLM(random_model(config, torch.float32, torch.device("cpu")), device="cpu", max_num_seqs=3,
              max_model_len=50, page_size=4, num_pages=3 * Ownership(4, 1, 0).local_pages(50))  # fmt: skip
    cache = llm.cache
    allocated = sum(t.numel() * t.element_size() for t in (*cache.pages.values(), *cache.recurrent.values(),
                                                           *cache.conv.values()))  # fmt: skip
    assert bench.cache_need(config, 1, 1, 3, 50, 4, 4) == allocated


def test_layouts_of_a_world():
    layouts = load_script("bench_helix").layouts
    assert layouts(1) == [(1, 1)] and layouts(4) == [(4, 1), (2, 2), (1, 4)] and layouts(4, cp=2) == [(2, 2)]
    assert layouts(2, cp=4) == []


def test_a_case_that_does_not_fit_is_skipped_with_the_sizes():
    skip_reason = load_script("bench_helix").skip_reason
    assert skip_reason(1 << 30, 16 << 30) is None
    assert skip_reason(13 << 30, 16 << 30) == "cache needs 13.0 GiB per rank (+4 GiB reserve), 16.0 GiB free"
