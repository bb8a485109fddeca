"""GPQA through `python -m kimi_helix.evals --gpqa-data FILE`: lm-eval's own task config on a local file."""

import json
import random

import pytest

pytest.importorskip("lm_eval")

import datasets  # noqa: E402
from lm_eval.tasks.gpqa.zeroshot.utils import process_docs  # noqa: E402

from kimi_helix.evals import gpqa  # noqa: E402
from kimi_helix.evals.__main__ import main  # noqa: E402

from .conftest import GPQA_COLUMNS, synthetic_rows, write_csv  # noqa: E402


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_gpqa_main_zeroshot_from_a_local_csv(gpqa_run):
    rows, _, out = gpqa_run
    [results_file] = out.rglob("results_*.json")
    metrics = json.loads(results_file.read_text())["results"]["gpqa_main_zeroshot"]
    assert 0 <= metrics["acc,none"] <= 1 and 0 <= metrics["acc_norm,none"] <= 1
    [samples_file] = out.rglob("samples_gpqa_main_zeroshot_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert len(samples) == len(rows)
    # lm-eval's own process_docs, on the global `random` that simple_evaluate seeds with its default seed 0.
    random.seed(0)
    expected = process_docs(datasets.Dataset.from_list(rows))
    for sample, want in zip(samples, expected):
        doc = sample["doc"]
        assert doc["Record ID"] == want["Record ID"]
        assert [doc[f"choice{k}"] for k in range(1, 5)] == [want[f"choice{k}"] for k in range(1, 5)]
        assert doc["answer"] == want["answer"] == sample["target"]
        assert want["Question"] in sample["arguments"]["gen_args_0"]["arg_0"]
    assert len({tuple(s["doc"][f"choice{k}"] for k in range(1, 5)) for s in samples}) == len(rows)


def test_missing_column_is_named(tmp_path, capsys):
    columns = [c for c in GPQA_COLUMNS if c != "Incorrect Answer 2"]
    data = write_csv(tmp_path / "gpqa.csv", synthetic_rows(), columns)
    assert main(["--model", "kimi_helix", "--tasks", "gpqa_main_zeroshot", "--gpqa-data", str(data)]) == 2
    assert "'Incorrect Answer 2'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"Question": "q", "Correct Answer": "a"}', "'Incorrect Answer 1'"),
        ("not json", "line 2 is not JSON"),
        (json.dumps({**synthetic_rows(1)[0], "Correct Answer": 4}), "'Correct Answer' must be a string"),
    ],
)
def test_malformed_jsonl_names_the_problem(tmp_path, line, message):
    path = tmp_path / "gpqa.jsonl"
    path.write_text(json.dumps(synthetic_rows(1)[0]) + "\n" + line + "\n")
    with pytest.raises(gpqa.GPQADataError, match=message):
        gpqa.check_gpqa_file(path)


def test_offline_without_a_local_file_says_how_to_pass_one(capsys, offline):
    assert main(["--model", "kimi_helix", "--model_args", "pretrained=x", "--tasks", "gpqa_diamond_zeroshot"]) == 2
    err = capsys.readouterr().err
    assert "gated" in err and "offline" in err and "--gpqa-data FILE" in err


def test_every_stock_gpqa_task_gets_a_local_yaml(tmp_path):
    data = write_csv(tmp_path / "gpqa.csv", synthetic_rows(2))
    names = gpqa.write_local_gpqa_tasks(data, tmp_path / "tasks")
    for variant in ("main", "diamond", "extended"):
        assert {f"gpqa_{variant}_zeroshot", f"gpqa_{variant}_n_shot", f"gpqa_{variant}_cot_zeroshot"} <= set(names)
    assert "leaderboard_gpqa_diamond" in names
