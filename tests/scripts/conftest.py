"""The scripts' smoke tests check that a script runs and writes well-formed rows, not what it measures: on the CPU
every timed case of `bench_common.bench_ms` runs its warm-up call and one timed call instead of `cpu_reps`."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_timed_call(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as the scripts themselves import bench_common
    import bench_common

    timed = bench_common.bench_ms

    def bench_ms(fn, device, graph=False, cpu_reps=3):
        return timed(fn, device, graph, cpu_reps=1)

    monkeypatch.setattr(bench_common, "bench_ms", bench_ms)
