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


@pytest.fixture(scope="module")
def launch(tiny_checkpoint, gpqa_run, task_index_file, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """One `torchrun --nproc-per-node 2` launch on the CPU (gloo) running `kimi_helix.evals` twice: data parallel
    ("dp") and tp = 2 ("tp") on `gpqa_run`'s data. {run: (output folder, both ranks' stderr)}."""
    _, data, _ = gpqa_run
    root = tmp_path_factory.mktemp("parallel_evals")
    runs = {"dp": gpqa_args(tiny_checkpoint, data), "tp": gpqa_args(tiny_checkpoint, data, ",tp=2")}
    runs = {name: [*args, "--output_path", str(root / name)] for name, args in runs.items()}
    spec = {"task_index": str(task_index_file), "logs": str(root), "runs": runs}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    done = subprocess.run(
        [*launcher, str(REPO / "tests" / "evals" / "parallel_runs.py"), str(root / "spec.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    logs = {name: "".join(p.read_text() for p in sorted(root.glob(f"{name}.rank*.log"))) for name in runs}
    return {name: (root / name, logs[name]) for name in runs}


def test_two_processes_split_requests_and_gather_the_same_results(launch, gpqa_run):
    _, _, one = gpqa_run
    out, stderr = launch["dp"]
    assert "on rank 1" in stderr
    # Rank 0 scores 3 of the 5 documents' 4 choices (rank 1 two, padded to as many requests), not all 20.
    assert "loglikelihood: 100%" in stderr and "12/12" in stderr and "20/20" not in stderr
    parallel, single = per_doc(out), per_doc(one)
    assert sorted(parallel) == list(range(5))
    for doc_id, (answer, resps) in single.items():
        assert parallel[doc_id][0] == answer
        assert parallel[doc_id][1] == pytest.approx(resps, abs=1e-5)


def test_tensor_parallel_run_equals_one_process(launch, gpqa_run):
    _, _, one = gpqa_run
    out, _ = launch["tp"]
    sharded, single = per_doc(out), per_doc(one)
    assert sorted(sharded) == sorted(single) == list(range(5))
    for doc_id, (answer, resps) in single.items():
        assert sharded[doc_id][0] == answer
        assert sharded[doc_id][1] == pytest.approx(resps, abs=1e-4)
