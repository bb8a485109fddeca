"""`plan_memory(tp, cp)` per-rank numbers equal what the Helix engine allocates on each rank: rank 0's pages of a
max_model_len sequence from `HelixPageLedger`, and the KDA state bytes per sequence of `HelixPagedCache`."""

import pytest
import torch

from kimi_helix.engine.planner import plan_memory
from kimi_helix.parallel import Mapping
from kimi_helix.parallel.distributed import Communicator
from kimi_helix.parallel.helix import helix_cache

from .harness import parallel_test_config


@pytest.mark.parametrize("tp,cp,max_len", [(1, 2, 37), (2, 2, 64), (1, 3, 5), (1, 4, 100), (4, 1, 9)])
def test_plan_per_rank_equals_engine(tp, cp, max_len):
    config, ps = parallel_test_config(), 4
    plan = plan_memory(config, "1GB", tp=tp, cp=cp, dtype=torch.float32, page_size=ps, max_model_len=max_len)
    per_rank_pages = []
    for rank in range(tp * cp):
        comm = Communicator(Mapping(tp=tp, cp=cp, rank=rank))  # no collectives: only the allocation is inspected
        cache = helix_cache(config, comm, 64, ps, 2, torch.float32, "meta")
        cache.ledger.admit(0, max_len, map_now=True)
        per_rank_pages.append(cache.ledger.pages_in_use)
        state = sum(t[0].numel() * t.element_size() for t in (*cache.conv.values(), *cache.recurrent.values()))
        assert state == plan.kda_state_bytes_per_sequence_per_rank
        page = sum(t[0].numel() * t.element_size() for t in cache.pages.values())
        assert page == plan.page_bytes
    assert max(per_rank_pages) == per_rank_pages[0]  # rank 0 (cp rank 0) is the fullest
    assert per_rank_pages[0] * plan.page_bytes == plan.mla_cache_bytes_per_sequence_per_rank
