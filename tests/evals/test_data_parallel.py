"""Data parallel under torchrun (2 CPU processes, gloo): the same per-sample answers as one process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from .conftest import gpqa_args  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_doc(out: Path) -> dict:
    [samples] = out.rglob("samples_gpqa_main_zeroshot_*.jsonl")
    # resps: per choice [[logprob, is_greedy]], logged as strings
    rows = map(json.loads, samples.read_text().splitlines())
    return {s["doc_id"]: (s["doc"]["answer"], [float(r[0][0]) for r in s["resps"]]) for s in rows}


def torchrun(args, out: Path) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m kimi_helix.evals ARGS --output_path OUT` on the CPU (gloo)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    run = subprocess.run(
        [*launch, "-m", "kimi_helix.evals", *args, "--output_path", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_two_processes_split_requests_and_gather_the_same_results(tiny_checkpoint, gpqa_run, tmp_path):
    _, data, one = gpqa_run
    run = torchrun(gpqa_args(tiny_checkpoint, data), tmp_path / "dp")
    assert "on rank 1" in run.stderr
    # Rank 0 scores 3 of the 5 documents' 4 choices (rank 1 two, padded to as many requests), not all 20.
    assert "loglikelihood: 100%" in run.stderr and "12/12" in run.stderr and "20/20" not in run.stderr
    parallel, single = per_doc(tmp_path / "dp"), per_doc(one)
    assert sorted(parallel) == list(range(5))
    for doc_id, (answer, resps) in single.items():
        assert parallel[doc_id][0] == answer
        assert parallel[doc_id][1] == pytest.approx(resps, abs=1e-5)


def test_tensor_parallel_run_equals_one_process(tiny_checkpoint, gpqa_run, tmp_path):
    _, data, one = gpqa_run
    torchrun(gpqa_args(tiny_checkpoint, data, ",tp=2"), tmp_path / "tp")
    sharded, single = per_doc(tmp_path / "tp"), per_doc(one)
    assert sorted(sharded) == sorted(single) == list(range(5))
    for doc_id, (answer, resps) in single.items():
        assert sharded[doc_id][0] == answer
        assert sharded[doc_id][1] == pytest.approx(resps, abs=1e-4)
