"""A rank that dies or raises mid-run makes the others abort with `RankFailureError` naming it; nothing hangs."""

import os
import signal

import torch

from kimi_helix.parallel import Mapping
from kimi_helix.parallel.distributed import Communicator, RankFailureError, init_distributed, run_guarded

from .harness import spawn


def _loop(rank, world, mode):
    ctx = init_distributed(timeout_s=10)
    comm = Communicator.create(Mapping(tp=world, cp=1, rank=rank), ctx)

    def main():
        for step in range(1000):
            if rank == 1 and step == 5:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("boom in rank 1")
            comm.all_reduce(torch.ones(4))
        return "finished"

    try:
        return run_guarded(main, ctx)
    except RankFailureError as e:
        return f"RankFailureError: {e}"


def test_killed_rank_is_named():
    results = spawn(_loop, 2, "kill", timeout_s=90)
    assert 1 not in results  # killed: it never reported
    status, message = results[0]
    assert status == "ok" and message.startswith("RankFailureError"), results
    assert "rank 1: stopped sending heartbeats" in message


def test_raising_rank_is_named_with_its_error():
    results = spawn(_loop, 2, "raise", timeout_s=90)
    assert results[1][0] == "error" and "boom in rank 1" in results[1][1]
    status, message = results[0]
    assert status == "ok" and "rank 1: ValueError: boom in rank 1" in message, results
