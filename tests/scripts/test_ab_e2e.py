"""scripts/ab_e2e.sh on the CPU: the packed package at a commit and this tree's each run the benchmark from their own
copy, rows land per side, and the summary pairs their cases; bad arguments exit 2 with the reason. Nothing here
checks what is measured."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ab_e2e.sh"
TINY = ["--device", "cpu", "--preset", "tiny", "--batches", "2", "--contexts", "64", "--verify-batches", "2",
        "--no-hf", "--no-prefill"]  # fmt: skip


def _ab(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, AB_DIR=str(tmp_path / "packs"), OUT=str(tmp_path / "out"))
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


def _head() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")


def test_each_side_runs_its_own_package_and_the_summary_pairs_the_cases(tmp_path):
    rev = _head()
    packed = _ab("pack", rev, tmp_path=tmp_path)
    assert packed.returncode == 0, packed.stderr
    assert (tmp_path / "packs" / f"{rev}.tgz").is_file()

    run = _ab("run", rev, "tree", "1", "--", *TINY, tmp_path=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = tmp_path / "out"
    roots = [line.rsplit(" from ", 1)[1] for line in (out / "ab.log").read_text().splitlines()
             if line.startswith("=== round")]  # fmt: skip
    assert len(roots) == 2 and roots[1] == str(ROOT) and roots[0] != str(ROOT)
    for side in (rev, "tree"):
        rows = [json.loads(line) for line in (out / f"ab_{side}.jsonl").read_text().splitlines()]
        assert {r["phase"] for r in rows} == {"decode", "verify"} and {r["commit"] for r in rows} == {side}
    summary = (out / "ab_summary.txt").read_text().splitlines()
    assert summary[0] == f"phase batch context {rev} (median ms) tree (median ms) ratio"
    cases = {tuple(line.split()[:3]) for line in summary[1:]}
    assert cases == {("decode", "2", "64"), ("verify", "2", "64")}
    for line in summary[1:]:
        base, tree, ratio = map(float, line.split()[3:])
        assert ratio == pytest.approx(tree / base, abs=1e-3)


@pytest.mark.parametrize(
    "args,message",
    [
        (("run", "abc1234", "tree", "x"), "ROUNDS must be a positive integer, got 'x'"),
        (("run", "abc1234", "tree"), "no {packs}/abc1234.tgz: run 'ab_e2e.sh pack abc1234' here and carry it"),
        (("frobnicate",), "usage: ab_e2e.sh pack REV | ab_e2e.sh run REV HEAD_COMMIT [ROUNDS] [-- BENCH_ARGS...]"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(tmp_path, args, message):
    done = _ab(*args, tmp_path=tmp_path)
    assert done.returncode == 2
    assert message.format(packs=tmp_path / "packs") in done.stderr
