"""Run by the data-parallel tests under `torchrun --nproc-per-node 2 tests/evals/parallel_runs.py SPEC`: every run
of SPEC (a JSON file: {"task_index": pickle of lm-eval's own task index, "logs": folder, "runs": {name: argv}}) is
one `python -m kimi_helix.evals ARGV` (its `main`) in this launch, one after another, each run's stderr on this
rank going to LOGS/NAME.rankR.log. One launch instead of one per run: the ranks start, import lm-eval and read its
task index once."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

from lm_eval.tasks._index import TaskIndex

from kimi_helix.evals.__main__ import main
from tests.evals.task_index import reusing


def run_logged(argv: list[str], log: Path) -> None:
    """`main(argv)` with this process's stderr (file descriptor 2: logging, tqdm, warnings) in `log`."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with log.open("w") as f:
            os.dup2(f.fileno(), 2)
            status = main(argv)
            sys.stderr.flush()
    except BaseException:
        sys.stderr.flush()
        os.dup2(saved, 2)
        sys.stderr.write(log.read_text()[-3000:])
        raise
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    if status != 0:
        raise SystemExit(f"kimi_helix.evals {argv} exited with {status}; see {log}")


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    TaskIndex.build = reusing({True: pickle.loads(Path(spec["task_index"]).read_bytes())})
    for name, argv in spec["runs"].items():
        run_logged(argv, Path(spec["logs"]) / f"{name}.rank{os.environ['RANK']}.log")
