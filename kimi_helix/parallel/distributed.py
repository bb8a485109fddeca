"""Process-group setup from the torchrun environment, the collectives the parallel model makes, and failure handling.

`init_distributed()` reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` (what torchrun sets),
uses NCCL on CUDA and gloo on CPU, and starts a heartbeat thread. Every collective goes through a `Communicator`,
which counts the bytes each rank sends per step and turns a failed or timed-out collective into `RankFailureError`
naming the rank that stopped: a dead peer makes every other rank raise within the timeout instead of hanging. The
heartbeat thread doubles as a watchdog that ends a rank whose main thread no error reaches (`DistContext.watch`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .mapping import Mapping

DEFAULT_TIMEOUT_S = 60.0
_PREFIX = "kimi_helix"


class RankFailureError(RuntimeError):
    """A collective failed because another rank died, raised an error or stopped answering."""


@dataclass
class DistContext:
    """One rank's process-group state: the store it shares with the other ranks and the heartbeat thread."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    timeout_s: float
    store: dist.Store
    heartbeat_s: float
    collectives: int = 0  # collectives this rank has entered, published with each heartbeat
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def report_failure(self, error: BaseException) -> None:
        """Tell the other ranks why this rank is stopping (read by their `failed_ranks`)."""
        # The store may be gone already; the stopped heartbeat then tells the story.
        with contextlib.suppress(Exception):
            self.store.set(f"{_PREFIX}/failed/{self.rank}", f"{type(error).__name__}: {error}"[:2000])

    def failed_ranks(self) -> dict[int, str]:
        """The ranks that failed first, with the reason; waits up to 3 heartbeats.

        First those that reported an error of their own, else those whose heartbeat stopped without a clean
        `close()` (killed), else live ones that never entered this collective (hung elsewhere). A rank that only
        reports a `RankFailureError` about another rank is named only when none is found: it names the first
        failure itself.
        """
        try:
            before = {r: self._beat(r) for r in self.others}
            deadline = time.monotonic() + 3 * self.heartbeat_s
            while True:
                keys = {r: f"{_PREFIX}/failed/{r}" for r in self.others}
                reports = {r: self.store.get(k).decode() for r, k in keys.items() if self.store.check([k])}
                own = {r: why for r, why in reports.items() if not why.startswith(RankFailureError.__name__)}
                if own or time.monotonic() > deadline:
                    break
                time.sleep(self.heartbeat_s / 4)
            stopped = {
                r: "stopped sending heartbeats (killed or hung)"
                for r in self.others
                if r not in reports and self._beat(r) == before[r] and not self._closed(r)
            }
            return own or stopped or self._behind(exclude=reports) or reports
        except Exception as e:  # noqa: BLE001 (the store lives on rank 0, or on torchrun's agent)
            return {0: f"the shared store is unreachable ({type(e).__name__}); rank 0 or the launcher is gone"}

    def _behind(self, exclude) -> dict[int, str]:
        """Live ranks that have not entered the collective this rank waits in (hung outside collectives): every
        rank makes the same sequence of collectives, so a lower count than ours means it never arrived."""
        live = [r for r in self.others if r not in exclude and self._progressed(r)]
        counts = {r: int(self.store.get(f"{_PREFIX}/progress/{r}")) for r in live}
        return {
            r: f"alive but stuck: it entered {n} collectives, this rank {self.collectives}"
            for r, n in counts.items()
            if n < self.collectives
        }

    def _progressed(self, rank: int) -> bool:
        return self.store.check([f"{_PREFIX}/progress/{rank}"])

    def _beat(self, rank: int) -> int:
        return self.store.add(f"{_PREFIX}/heartbeat/{rank}", 0)

    def _closed(self, rank: int) -> bool:
        return self.store.check([f"{_PREFIX}/closed/{rank}"])

    def watch(self) -> None:
        """The heartbeat thread's loop: beat every `heartbeat_s`, and watch the other ranks' beats.

        A peer that stops beating without closing fails this rank's next collective, which raises
        `RankFailureError`. The watchdog is the backstop for a main thread that no exception reaches (a CUDA
        synchronisation behind an NCCL kernel waiting for the dead peer): when a peer, or the store, has been silent
        for the collective timeout less one beat, it names the peer on stderr and ends the process (exit code 1),
        before NCCL's own watchdog would abort the collective without naming anyone.
        """
        limit = self.timeout_s - self.heartbeat_s
        seen = {r: (-1, time.monotonic()) for r in self.others}
        store_ok = time.monotonic()
        while not self._stop.wait(self.heartbeat_s):
            now = time.monotonic()
            try:
                self.store.add(f"{_PREFIX}/heartbeat/{self.rank}", 1)
                self.store.set(f"{_PREFIX}/progress/{self.rank}", str(self.collectives))
                for r in self.others:
                    beat = self._beat(r)
                    if beat != seen[r][0]:
                        seen[r] = (beat, now)
                    elif now - seen[r][1] > limit and not self._closed(r):
                        self._abort(f"rank {r}: sent no heartbeat for {limit:.0f} s (killed or hung)")
                store_ok = now
            except Exception as e:  # noqa: BLE001 (rank 0 or the launcher hosting the store is gone)
                if now - store_ok > limit:
                    self._abort(f"rank 0: the shared store is unreachable ({type(e).__name__}) for {limit:.0f} s")

    def _abort(self, reason: str) -> None:
        if self._stop.is_set():  # closed meanwhile: the run ended cleanly
            return
        error = RankFailureError(f"rank {self.rank}: watchdog: {reason}; exiting")
        self.report_failure(error)
        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        os._exit(1)

    def close(self) -> None:
        """Stop the heartbeat (marked as a clean exit, so no peer's watchdog fires) and leave the group."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"{_PREFIX}/closed/{self.rank}", "1")
        if dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, device: str | torch.device | None = None) -> DistContext:
    """Join the process group described by torchrun's environment variables.

    Args:
        timeout_s: how long a collective may wait for a peer before every rank aborts (`RankFailureError`).
        device: default `cuda:LOCAL_RANK` when CUDA is available, else `cpu`; NCCL on CUDA, gloo on CPU.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed needs torchrun's environment; {missing} are not set")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # Under torchrun the agent hosts the store; a bare launch (tests) lets rank 0 host it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store, timeout=timeout)
    store = dist.PrefixStore(f"{_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    ctx = DistContext(rank, world, device, backend, timeout_s, store, heartbeat_s=min(1.0, timeout_s / 10))
    store.add(f"{_PREFIX}/heartbeat/{rank}", 1)
    threading.Thread(target=ctx.watch, name=f"{_PREFIX}-heartbeat", daemon=True).start()
    return ctx


class Communicator:
    """The collectives of one rank, over explicit process groups, with per-step byte counters.

    `world_group` spans all `tp * cp` ranks (all-reduce, all-gather, broadcast); `cp_group` is this rank's cp group
    (the Helix all-to-all). Counters record the bytes this rank sends to peers, per collective kind, since the last
    `reset_counters()`. With `ctx` given, a failed collective raises `RankFailureError` naming the failing rank.
    """

    def __init__(self, mapping: Mapping, world_group=None, cp_group=None, ctx: DistContext | None = None):
        self.mapping = mapping
        self.world_group = world_group
        self.cp_group = cp_group
        self.ctx = ctx
        self.bytes_sent: Counter[str] = Counter()

    @classmethod
    def create(cls, mapping: Mapping, ctx: DistContext | None = None) -> Communicator:
        """Build the groups of `mapping` over the default process group (every rank must call this together)."""
        if mapping.world_size == 1:
            return cls(mapping, ctx=ctx)
        if not dist.is_initialized() or dist.get_world_size() != mapping.world_size:
            raise RuntimeError(f"Communicator needs a process group of tp * cp = {mapping.world_size} ranks")
        cp_group = None
        for ranks in mapping.all_cp_groups():  # every rank creates every group, in the same order
            group = dist.new_group(ranks) if mapping.cp > 1 else None
            if mapping.rank in ranks:
                cp_group = group
        return cls(mapping, dist.group.WORLD, cp_group, ctx)

    def reset_counters(self) -> None:
        self.bytes_sent.clear()

    def _run(self, kind: str, nbytes: int, op):
        self.bytes_sent[kind] += nbytes
        if self.ctx is not None:
            self.ctx.collectives += 1
        try:
            return op()
        except Exception as e:
            if self.ctx is None:
                raise
            failed = self.ctx.failed_ranks()
            names = ", ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())) or "no rank reported"
            raise RankFailureError(
                f"rank {self.mapping.rank}: {kind} failed (collective timeout {self.ctx.timeout_s:g} s): {names}"
            ) from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over all ranks, in place; returns it."""
        if self.mapping.world_size > 1:
            self._run("all_reduce", x.numel() * x.element_size(), lambda: dist.all_reduce(x, group=self.world_group))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x [..., n] along the last dim, in rank order: [..., world * n]."""
        w = self.mapping.world_size
        if w == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(w)]
        nbytes = x.numel() * x.element_size() * (w - 1)
        self._run("all_gather", nbytes, lambda: dist.all_gather(parts, x.contiguous(), group=self.world_group))
        return torch.cat(parts, dim=-1)

    def all_to_all_cp(self, x: torch.Tensor) -> torch.Tensor:
        """x [cp, ...]: chunk c goes to cp rank c; returns [cp, ...] whose chunk c came from cp rank c."""
        cp = self.mapping.cp
        if cp == 1:
            return x
        x = x.contiguous()
        out = torch.empty_like(x)
        nbytes = x.numel() * x.element_size() * (cp - 1) // cp
        self._run("all_to_all", nbytes, lambda: dist.all_to_all_single(out, x, group=self.cp_group))
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s x on every rank, in place."""
        if self.mapping.world_size > 1:
            nbytes = x.numel() * x.element_size() if self.mapping.rank == src else 0
            self._run("broadcast", nbytes, lambda: dist.broadcast(x, src, group=self.world_group))
        return x

    def barrier(self) -> None:
        if self.mapping.world_size > 1:
            self._run("barrier", 0, lambda: dist.barrier(group=self.world_group))


def run_guarded(main, ctx: DistContext):
    """Run `main()` on this rank; if it raises, tell the other ranks why (so their next collective names this
    rank) and re-raise. The process group is closed either way."""
    try:
        return main()
    except BaseException as e:
        ctx.report_failure(e)
        raise
    finally:
        ctx.close()
