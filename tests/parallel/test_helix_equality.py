"""Helix cp x tp on gloo ranks equals one process: logits to 1e-5 relative and identical greedy tokens.

Each rank builds the same seeded model, runs the single-process reference itself (the engine's `PagedCache`), then
its shard under `parallelize` with a `HelixPagedCache`. Prompts are shorter than a page, exactly a page and many
pages, batched together; the verify step's groups straddle page boundaries, so some ranks own none of a group.
"""

import copy

import pytest
import torch

from kimi_helix.engine.cache import PagedCache, PageLedger
from kimi_helix.modeling.model import KimiK3ForCausalLM
from kimi_helix.parallel import Mapping
from kimi_helix.parallel.distributed import Communicator, init_distributed
from kimi_helix.parallel.helix import helix_cache, step_bytes
from kimi_helix.parallel.tp import parallelize, shard_model

from .harness import PAGE_SIZE, check_all_ok, drive, parallel_test_config, spawn

PROMPTS = [[5, 9, 2], [7, 1, 3, 8], list(range(10, 27))]  # < 1 page, = 1 page, 5 pages (page_size 4)
DRAFTS = [[11, 12, 13], [4, 5, 6], [40, 41, 42]]  # groups of 4 at positions 5.., 6.., 19..: all straddle pages


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def layouts(world: int) -> list[tuple[int, int]]:
    """Every (tp, cp) with tp in {1, 2, 4} and tp * cp = world."""
    return [(tp, world // tp) for tp in (1, 2, 4) if world % tp == 0]


def _equality_rank(rank, world):
    """Every layout of `world` ranks in one launch (a spawn costs seconds): per layout, this rank's results."""
    ctx = init_distributed(timeout_s=60)
    try:
        torch.manual_seed(0)
        config = parallel_test_config()
        model = KimiK3ForCausalLM(config).eval()
        ref_cache = PagedCache(config, PageLedger(64, PAGE_SIZE, 4), torch.float32, "cpu")
        ref_logits, ref_tokens, _ = drive(model, ref_cache, PROMPTS, 3, DRAFTS)
        out = {}
        for tp, cp in layouts(world):
            mapping = Mapping(tp=tp, cp=cp, rank=rank)
            comm = Communicator.create(mapping, ctx)
            sharded = parallelize(shard_model(copy.deepcopy(model), mapping), comm)
            cache = helix_cache(config, comm, 64, PAGE_SIZE, 4, torch.float32, "cpu")
            logits, tokens, sent = drive(sharded, cache, PROMPTS, 3, DRAFTS, comm)
            out[tp, cp] = {
                "max_rel": max(_relative(a, b) for a, b in zip(logits, ref_logits)),
                "tokens_equal": tokens == ref_tokens,
                "pages_in_use": cache.ledger.pages_in_use,
                "ref_pages": ref_cache.ledger.pages_in_use,
                "decode_bytes": sent[1:4],  # three decode steps, each at a longer context
            }
        return out
    finally:
        ctx.close()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_helix_matches_single_process(world):
    """(tp, cp) in (1, 2), (2, 1); (1, 3); (1, 4), (2, 2), (4, 1)."""
    per_rank = check_all_ok(spawn(_equality_rank, world), world)
    for tp, cp in layouts(world):
        results = [r[tp, cp] for r in per_rank]
        for rank, r in enumerate(results):
            assert r["max_rel"] <= 1e-5, (tp, cp, rank, r)
            assert r["tokens_equal"], (tp, cp, rank, r)
            # docs/helix.md's formula (fp32; the harness samples on the host, so nothing is broadcast)
            want = step_bytes(parallel_test_config(), tp, cp, len(PROMPTS), len(PROMPTS), 0, 4, rank)
            assert r["decode_bytes"][0] == want, (tp, cp, rank, r)
            assert r["decode_bytes"][1] == r["decode_bytes"][0] == r["decode_bytes"][2]  # not context-dependent
        # Each rank's ledger holds only its own pages, and together at least the single-process cache's pages.
        if tp == 1:
            assert sum(r["pages_in_use"] for r in results) >= results[0]["ref_pages"]
            assert max(r["pages_in_use"] for r in results) < results[0]["ref_pages"]
