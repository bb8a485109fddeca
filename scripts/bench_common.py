"""Shared pieces of the benchmark scripts: run metadata, timing, the roofline measurements and JSONL output.

The scripts import it from their own directory (``python scripts/bench_*.py`` puts ``scripts/`` on ``sys.path``;
they add it themselves when loaded by path, as the tests do).
"""

from __future__ import annotations

import datetime
import functools
import gc
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import TextIO

import torch

__all__ = [
    "JsonlWriter",
    "bench_ms",
    "copy_tbps",
    "git_commit",
    "int_list",
    "matmul_tflops",
    "precompile",
    "print_markdown_table",
    "profile_kernels",
    "release",
    "run_metadata",
    "sync",
]


def git_commit() -> str:
    """``$KIMI_HELIX_COMMIT`` when set (the GPU machine gets a copy of the tree without ``.git``), else
    ``git rev-parse HEAD`` of this checkout, else ``"unknown"``."""
    if os.environ.get("KIMI_HELIX_COMMIT"):
        return os.environ["KIMI_HELIX_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def run_metadata() -> dict:
    """``gpu`` (the CUDA device name, or "cpu"), ``date`` (UTC, ISO 8601, seconds) and ``commit`` of this run."""
    return dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
    )


def bench_ms(fn, device: torch.device | str, graph: bool = False, cpu_reps: int = 3) -> float:
    """Milliseconds of fn(). On the GPU: triton's do_bench (CUDA events, median), or with ``graph`` the mean of
    CUDA-graph replays; on the CPU: the median wall clock of ``cpu_reps`` calls after one warm-up call."""
    if torch.device(device).type == "cuda":
        import triton.testing

        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=100)
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def precompile(worker, jobs: list, processes: int, device: torch.device | str) -> list[str | None]:
    """Runs worker(job) for every job in a pool of spawned processes, so that Triton compiles (and caches on disk)
    every variant before a timing pass; returns each job's error as text, None where it ran. Off the GPU, or with
    one process, nothing runs and every entry is None."""
    if processes <= 1 or torch.device(device).type != "cuda":
        return [None] * len(jobs)
    with mp.get_context("spawn").Pool(processes) as pool:
        return pool.map(functools.partial(_error_of, worker), jobs, chunksize=1)


def _error_of(worker, job) -> str | None:
    try:
        worker(job)
    except Exception as err:  # a variant that does not fit is recorded, not fatal
        return f"{type(err).__name__}: {str(err)[:200]}"
    return None


def copy_tbps(device: torch.device | str, gib: float = 1) -> float:
    """Device-to-device copy bandwidth in TB/s of a ``gib`` GiB bf16 buffer, counting bytes read plus written."""
    n_bytes = int(gib * (1 << 30))
    src = torch.randn(n_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * n_bytes / bench_ms(lambda: dst.copy_(src), device) / 1e9


def matmul_tflops(device: torch.device | str, n: int = 8192) -> float:
    """bf16 ``[n, n] @ [n, n]`` matmul rate in TFLOP/s (``2 n^3`` flops a call)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / bench_ms(lambda: a @ b, device) / 1e9


class JsonlWriter:
    """Appends one JSON object a line to ``path`` (parent directories created), flushed after every line so that
    a run killed part way (a timeout) keeps the cases it finished. ``path`` None writes no file. ``echo``, a text
    stream such as ``sys.stderr``, gets each line too; ``records`` lists what was written, in order.

    Use as a context manager: ``with JsonlWriter(out / "x.jsonl") as results: results.write(record)``.
    """

    def __init__(self, path: Path | str | None, echo: TextIO | None = None):
        self.path = None if path is None else Path(path)
        self.echo = echo
        self.records: list[dict] = []
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        self.records.append(record)
        for stream in (self._file, self.echo):
            if stream is not None:
                stream.write(line)
                stream.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def int_list(text: str) -> list[int]:
    """An argparse type: "1,8,64" -> [1, 8, 64]."""
    return [int(x) for x in text.split(",")]


def print_markdown_table(rows: list[dict], cols: list[str]) -> None:
    """Print `rows` as a Markdown table of those of `cols` that some row has (blank where a row lacks one)."""
    cols = [c for c in cols if any(c in r for r in rows)]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (nothing to wait for off the GPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device | str) -> None:
    """Free what the last case left: collect its objects, then hand the allocator's cached blocks back."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def profile_kernels(fn, device: torch.device | str, steps: int, top: int = 0) -> tuple[float | None, list[dict]]:
    """CUDA kernel events per call of fn over `steps` profiled calls (memcpy/memset excluded), and the `top`
    kernels by GPU time per call (name, calls and microseconds per step); (None, []) off the GPU."""
    if torch.device(device).type != "cuda":
        return None, []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)  # microseconds
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    table = [dict(kernel=name[:90], calls=len(t) / steps, us=round(sum(t) / steps, 1)) for name, t in ranked]
    return len(kernels) / steps, table
