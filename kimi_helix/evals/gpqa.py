"""GPQA from a local file: the stock lm-eval `gpqa_*` tasks with their dataset swapped for a CSV or JSONL.

GPQA is gated on the Hub, so offline machines cannot load `Idavidrein/gpqa`. `write_local_gpqa_tasks` writes, for
every stock GPQA task file of the installed lm-eval, a YAML that `include:`s it and overrides only where the data
comes from; prompts, `process_docs` (with its choice shuffling), few-shot setup and metrics stay lm-eval's own.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import yaml

REQUIRED_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
GATED_DATASET = "Idavidrein/gpqa"
# The folders of lm-eval's GPQA tasks, relative to lm_eval/tasks.
STOCK_TASK_DIRS = ("gpqa", "leaderboard/gpqa")
OFFLINE_HINT = (
    f"GPQA ({GATED_DATASET}) is a gated dataset on the Hugging Face Hub and cannot be reached offline "
    "(or without accepting its terms and logging in). Pass a local copy instead: "
    "--gpqa-data FILE (CSV or JSONL with the columns " + ", ".join(REQUIRED_COLUMNS) + ")."
)


class GPQADataError(ValueError):
    """A local GPQA file that cannot be used; the message names the file, the row and the missing column."""


def check_gpqa_file(path: str | Path) -> list[dict]:
    """Check that `path` is a CSV (`.csv`) or JSONL (`.jsonl`/`.json`) GPQA file with every required column, as text,
    in every row; return the rows."""
    path = Path(path)
    if not path.is_file():
        raise GPQADataError(f"--gpqa-data {path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = _csv_rows(path)
    elif suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path)
    else:
        raise GPQADataError(f"--gpqa-data {path}: the file must end in .csv, .jsonl or .json, got {suffix!r}")
    checked = []
    for line, row in rows:
        missing = [c for c in REQUIRED_COLUMNS if row.get(c) is None]
        if missing:
            raise GPQADataError(f"--gpqa-data {path}: row at line {line} has no {missing[0]!r} column")
        not_text = [c for c in REQUIRED_COLUMNS if not isinstance(row[c], str)]
        if not_text:
            raise GPQADataError(
                f"--gpqa-data {path}: line {line}: {not_text[0]!r} must be a string, got {row[not_text[0]]!r}"
            )
        checked.append(row)
    if not checked:
        raise GPQADataError(f"--gpqa-data {path}: the file has no questions")
    return checked


def _csv_rows(path: Path):
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise GPQADataError(f"--gpqa-data {path}: the header has no {missing[0]!r} column (it has {header})")
        for row in reader:
            yield reader.line_num, row


def _jsonl_rows(path: Path):
    with path.open(encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise GPQADataError(f"--gpqa-data {path}: line {line} is not JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise GPQADataError(f"--gpqa-data {path}: line {line} is not a JSON object")
            yield line, row


def stock_gpqa_task_files() -> dict[str, Path]:
    """Task name -> the installed lm-eval's YAML for every GPQA task (e.g. gpqa_main_zeroshot)."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).resolve().parent
    files = {}
    for folder in STOCK_TASK_DIRS:
        for path in sorted((root / folder).rglob("*.yaml")):
            # The leaf task files are plain YAML (their templates hold the `!function` tags).
            config = yaml.safe_load(path.read_text()) if not path.name.startswith("_") else None
            if isinstance(config, dict) and "task" in config and "include" in config:
                files[config["task"]] = path
    return files


def write_local_gpqa_tasks(data_file: str | Path, out_dir: str | Path) -> list[str]:
    """Write into `out_dir` one YAML per stock GPQA task, reading `data_file` instead of the Hub; return the names."""
    rows = check_gpqa_file(data_file)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    # One JSONL of text cells for `datasets`' json loader: its csv loader would read numeric answers as numbers
    # (the Hub's copy has text), which lm-eval's GPQA preprocessing cannot strip.
    local = out_dir / "gpqa_local.jsonl"
    with local.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    names = []
    for task, stock in stock_gpqa_task_files().items():
        override = {
            "include": str(stock),
            "task": task,
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"train": str(local)}},
        }
        (out_dir / f"{task}.yaml").write_text(yaml.safe_dump(override, sort_keys=False))
        names.append(task)
    return names


def requests_gpqa(tasks: str | list[str] | None) -> bool:
    """Whether an lm-eval `--tasks` value (comma-separated, or a list of such) names a GPQA task, group or tag."""
    values = [tasks] if isinstance(tasks, str) else list(tasks or [])
    return any("gpqa" in name for value in values for name in str(value).split(","))


def offline() -> bool:
    """Whether the Hub is switched off for this process (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
