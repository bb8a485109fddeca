"""On the GPU: nothing inside a graphed decode or verify step syncs the host, and a whole `LLM.step` syncs once,
for the copy-out of its sampled tokens. Run: `python -m pytest -m gpu tests/engine/test_runner_gpu.py`."""

from __future__ import annotations

import warnings

import pytest
import torch

from kimi_helix.engine.cuda_graph import GraphKey
from kimi_helix.modeling.batch import Phase

from .test_cuda_graph import _llm, _model, _prefilled, _prompts

pytestmark = pytest.mark.gpu


def _syncs_of(fn) -> int:
    """How many host syncs `fn` makes (torch's sync debug mode, warning per sync)."""
    mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    return sum("synchroniz" in str(w.message) for w in caught)


def test_graphed_steps_never_sync_the_host():
    model = _model("cuda")
    llm = _llm(model, graphs=True)
    requests = _prefilled(llm, _prompts(3))
    graphs = llm.runner.graphs
    graphs.capture(GraphKey(Phase.DECODE, 4, 1))  # capture itself synchronises; the steps after must not
    assert GraphKey(Phase.DECODE, 4, 1) in graphs.graphs, graphs.uncapturable
    step = llm.scheduler.schedule()
    assert _syncs_of(lambda: llm.runner.run(step)) == 0
    for r in requests:  # the requests did not advance: the verify group re-runs the decode's position
        r.draft_token_ids = [5, 6, 7]
    graphs.capture(GraphKey(Phase.VERIFY, 4, 4))
    step = llm.scheduler.schedule()
    assert step.phases == [Phase.VERIFY] * 3 and graphs.key_for(step) in graphs.graphs
    assert _syncs_of(lambda: llm.runner.run(step)) == 0
    assert set(llm.cache.verify_records[next(iter(llm.cache.conv))]) == {r.request_id for r in requests}


def test_a_greedy_engine_step_syncs_once():
    """A synchronous step (asynchronous scheduling off: `test_async_scheduling.py` covers the overlapped one)."""
    llm = _llm(_model("cuda"), graphs=True)
    _prefilled(llm, _prompts(3))
    llm.step()  # captures the decode graph
    assert _syncs_of(llm.step) == 1  # the sampled tokens' copy-out
    assert llm.runner.buffers.host_bytes.is_pinned()
