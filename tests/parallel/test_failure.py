"""A rank that dies or raises mid-run makes the others abort with `RankFailureError` naming it; nothing hangs."""

import os
import signal

import torch

from kimi_helix.engine.llm import LLM
from kimi_helix.engine.sampling import SamplingParams
from kimi_helix.modeling.model import KimiK3ForCausalLM
from kimi_helix.parallel import Mapping
from kimi_helix.parallel.distributed import Communicator, RankFailureError, init_distributed, run_guarded

from .harness import parallel_test_config, spawn


def _loop(rank, world):
    ctx = init_distributed(timeout_s=10)
    comm = Communicator.create(Mapping(tp=world, cp=1, rank=rank), ctx)

    def main():
        for step in range(1000):
            if rank == 1 and step == 5:
                raise ValueError("boom in rank 1")
            comm.all_reduce(torch.ones(4))
        return "finished"

    try:
        return run_guarded(main, ctx)
    except RankFailureError as e:
        return f"RankFailureError: {e}"


def _generate_and_die(rank, world):
    """Helix generation (cp = 2) whose rank 1 is killed at its fourth step; the LLM joins the group itself."""
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(parallel_test_config()).eval()
    llm = LLM(model, context_parallel_size=2, page_size=4, max_num_seqs=2, device="cpu", dist_timeout_s=4)
    if rank == 1:
        run = llm.runner.run

        def dying(step):
            if len(llm.metrics) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return run(step)

        llm.runner.run = dying
    try:
        llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
        return "finished"
    except RankFailureError as e:
        return f"RankFailureError: {e}"
    finally:
        llm.comm.ctx.close()


def test_rank_killed_mid_generation_is_named():
    results = spawn(_generate_and_die, 2, timeout_s=90)
    assert 1 not in results  # killed: it never reported
    status, message = results[0]
    assert status == "ok" and message.startswith("RankFailureError"), results
    assert "rank 1: stopped sending heartbeats" in message


def test_raising_rank_is_named_with_its_error():
    results = spawn(_loop, 2, timeout_s=90)
    assert results[1][0] == "error" and "boom in rank 1" in results[1][1]
    status, message = results[0]
    assert status == "ok" and "rank 1: ValueError: boom in rank 1" in message, results
