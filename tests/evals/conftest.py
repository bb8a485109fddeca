"""Shared by the eval tests: a tiny random checkpoint with the byte tokenizer, made-up GPQA rows, one in-process
GPQA run on them, and lm-eval's index of its own tasks built once a session."""

import csv
from pathlib import Path

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.evals import gpqa
from kimi_helix.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_byte_tokenizer

from ..modeling.conftest import tiny_kwargs

GPQA_COLUMNS = [*gpqa.REQUIRED_COLUMNS, "Record ID", "Subdomain"]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Folder of a random fp32 `tiny` model (vocab = the byte tokenizer's 259 ids + 1) and its tokenizer."""
    folder = tmp_path_factory.mktemp("tiny_ckpt")
    torch.manual_seed(0)
    config = KimiK3Config(
        **tiny_kwargs(vocab_size=260, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    )
    KimiK3ForCausalLM(config).eval().save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def lm_eval_tasks_indexed_once():
    """lm-eval's own task index built once a session (`task_index`); yields it ({resolve_includes: index}, filled
    on first use), or None without lm-eval."""
    try:
        from lm_eval.tasks._index import TaskIndex

        from .task_index import reusing
    except ImportError:  # the tests that need lm-eval skip themselves
        yield None
        return
    own_index = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TaskIndex, "build", reusing(own_index))
        yield own_index


@pytest.fixture(scope="session")
def task_index_file(lm_eval_tasks_indexed_once, tmp_path_factory) -> Path:
    """lm-eval's own task index (the session's) pickled, for the ranks a test launches (`parallel_runs.py`)."""
    import pickle

    from lm_eval.tasks._index import TaskIndex

    from .task_index import OWN

    TaskIndex.build([OWN])  # fills the session's index if no test has yet
    path = tmp_path_factory.mktemp("task_index") / "own.pickle"
    path.write_bytes(pickle.dumps(lm_eval_tasks_indexed_once[True]))
    return path


def synthetic_rows(n=5):
    """Made-up questions in GPQA's columns (numeric answers too: they must stay text)."""
    return [
        {
            "Question": f"A box holds {i} red and {i + 2} blue balls. How many balls are in it?",
            "Correct Answer": str(2 * i + 2),
            "Incorrect Answer 1": str(2 * i + 3),
            "Incorrect Answer 2": f"{i} balls  [title] none",
            "Incorrect Answer 3": "It cannot be known",
            "Record ID": f"rec{i:03d}",
            "Subdomain": "Arithmetic",
        }
        for i in range(1, n + 1)
    ]


def write_csv(path, rows, columns=GPQA_COLUMNS):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def gpqa_args(checkpoint, data, extra_model_args=""):
    """`python -m kimi_helix.evals` arguments: gpqa_main_zeroshot on the CPU from the local file `data`."""
    model_args = f"pretrained={checkpoint},dtype=float32,device=cpu{extra_model_args}"
    args = ["--model", "kimi_helix", "--model_args", model_args, "--tasks", "gpqa_main_zeroshot"]
    return [*args, "--gpqa-data", str(data), "--log_samples"]


@pytest.fixture(scope="session")
def gpqa_run(tiny_checkpoint, tmp_path_factory):
    """One in-process `python -m kimi_helix.evals` GPQA run, offline, on `synthetic_rows(5)`: (rows, data file,
    output folder). The GPQA test checks it; the parallel tests compare their runs with it."""
    from kimi_helix.evals.__main__ import main

    root = tmp_path_factory.mktemp("gpqa_run")
    rows = synthetic_rows(5)
    data = write_csv(root / "gpqa.csv", rows)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        assert main([*gpqa_args(tiny_checkpoint, data), "--output_path", str(root / "out")]) == 0
    return rows, data, root / "out"
