"""A rank that dies or raises mid-run makes the others abort with `RankFailureError` naming it, within the collective
timeout; nothing hangs and no process stays."""

import os
import signal
import sys
import time

import pytest
import torch

from kimi_helix.engine.llm import LLM
from kimi_helix.engine.sampling import SamplingParams
from kimi_helix.modeling.model import KimiK3ForCausalLM
from kimi_helix.parallel import Mapping
from kimi_helix.parallel.distributed import Communicator, RankFailureError, init_distributed, run_guarded

from .harness import collect, parallel_test_config, spawn, start, stop

TIMEOUT_S = 6.0  # the collective timeout the ranks run with
MARGIN_S = 30.0  # process start-up and teardown on a loaded CPU


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


def _decode_until_killed(rank, world, victim):
    """Helix generation (cp = world) whose rank `victim` SIGKILLs itself at its fourth step (the prefill and two
    decodes done); the other ranks let the `RankFailureError` end their process."""
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(parallel_test_config()).eval()
    llm = LLM(model, context_parallel_size=world, page_size=4, max_num_seqs=2, device="cpu", dist_timeout_s=TIMEOUT_S)
    if rank == victim:
        run = llm.runner.run

        def dying(step):
            if len(llm.metrics) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return run(step)

        llm.runner.run = dying
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    return run_guarded(lambda: llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], params, use_tqdm=False), llm.comm.ctx)


def _exits_after_kill(procs, victim: int) -> dict[int, float]:
    """Seconds from the victim's death to each other rank's exit (inf for a rank still running after the
    timeout and the margin)."""
    while procs[victim].exitcode is None:
        time.sleep(0.02)
    killed, exited = time.monotonic(), {}
    while len(exited) < len(procs) - 1 and time.monotonic() < killed + TIMEOUT_S + MARGIN_S:
        for r, p in enumerate(procs):
            if r != victim and r not in exited and p.exitcode is not None:
                exited[r] = time.monotonic() - killed
        time.sleep(0.02)
    return {r: exited.get(r, float("inf")) for r in range(len(procs)) if r != victim}


@pytest.mark.parametrize("world, victim", [(2, 0), (3, 2)], ids=["store-host-killed", "peer-killed"])
def test_killed_rank_ends_every_rank_naming_it(world, victim):
    """Every surviving rank exits non-zero within the collective timeout (plus start-up margin), its error names
    the dead rank, and no process stays behind."""
    procs, queue = start(_decode_until_killed, world, victim)
    try:
        exits = _exits_after_kill(procs, victim)
        results: dict = {}
        collect(procs, queue, results, time.monotonic() + 10)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        stop(procs)
    assert not alive, f"ranks {alive} still running"
    assert procs[victim].exitcode == -signal.SIGKILL and victim not in results
    for rank, seconds in exits.items():
        assert seconds <= TIMEOUT_S + MARGIN_S, (rank, exits)
        assert procs[rank].exitcode == 1, (rank, procs[rank].exitcode, results.get(rank))
        status, message = results[rank]
        assert status == "error" and message.startswith("RankFailureError"), (rank, message)
        why = "the shared store is unreachable" if victim == 0 else "stopped sending heartbeats"
        assert f"rank {victim}: {why}" in message.splitlines()[0], (rank, message)


def test_raising_rank_is_named_with_its_error():
    results = spawn(_loop, 2, timeout_s=90)
    assert results[1][0] == "error" and "boom in rank 1" in results[1][1]
    status, message = results[0]
    assert status == "ok" and "rank 1: ValueError: boom in rank 1" in message, results


def _stuck_after_peer_dies(rank, world, log):
    """Rank 1 is killed; rank 0's main thread sleeps where no collective error can reach it (as behind a CUDA
    synchronisation on an NCCL kernel that waits for the dead peer): only the watchdog can end it."""
    ctx = init_distributed(timeout_s=TIMEOUT_S)
    # rank 1 dies only once rank 0 is past its own set-up: killed while rank 0 still connected its gloo pairs, it
    # made rank 0's init fail before the watchdog ran
    if rank == 1:
        ctx.store.wait(["test/rank0_ready"])
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stderr = open(log, "w", buffering=1)  # noqa: SIM115 (the watchdog writes here, then ends the process)
    ctx.store.set("test/rank0_ready", "1")
    time.sleep(TIMEOUT_S + MARGIN_S + 30)
    ctx.close()
    return "slept through"


def test_watchdog_ends_a_rank_stuck_outside_collectives(tmp_path):
    procs, queue = start(_stuck_after_peer_dies, 2, str(tmp_path / "rank0.log"))
    try:
        exits = _exits_after_kill(procs, 1)
    finally:
        stop(procs)
    assert exits[0] <= TIMEOUT_S + MARGIN_S and procs[0].exitcode == 1, (exits, procs[0].exitcode)
    line = (tmp_path / "rank0.log").read_text().strip().splitlines()[-1]
    assert line.startswith("RankFailureError: rank 0: watchdog: rank 1: sent no heartbeat"), line


def _one_rank_hangs(rank, world):
    """Rank 1 stops calling collectives (its heartbeat thread still runs) while rank 0 waits in an all-reduce."""
    ctx = init_distributed(timeout_s=TIMEOUT_S)
    comm = Communicator.create(Mapping(tp=world, cp=1, rank=rank), ctx)
    try:
        for step in range(10):
            if rank == 1 and step == 3:
                _hang_until_closed(ctx, peer=0, limit_s=3 * TIMEOUT_S)
                return "woke up"
            comm.all_reduce(torch.ones(4))
        return "finished"
    finally:
        ctx.close()


def _hang_until_closed(ctx, peer: int, limit_s: float) -> None:
    """Stay alive outside any collective until `peer` has left (its error is then written), at most `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if ctx.store.check([f"kimi_helix/closed/{peer}"]):
                return
        except Exception:  # the peer hosted the store and is gone
            return
        time.sleep(0.1)


def test_hung_rank_is_named_by_its_collective_count():
    results = spawn(_one_rank_hangs, 2, timeout_s=90)
    status, message = results[0]
    assert status == "error" and "rank 1: alive but stuck: it entered 3 collectives, this rank 4" in message, results
