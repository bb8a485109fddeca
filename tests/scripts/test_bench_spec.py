"""scripts/bench_spec.py --smoke: plain, ngram and DSpark on a tiny random model on the CPU, rows and table; and
the held-out prompts of the demo corpus (scripts/demo_prompts.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .conftest import SCRIPTS, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_spec")


def test_smoke_run_writes_one_row_per_case_and_matches_plain(bench, tmp_path, capsys):
    out = tmp_path / "spec.jsonl"
    assert bench.main(["--smoke", "--k", "2", "--batch-sizes", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["method"], r["k"], r["batch_size"]) for r in rows] == [
        ("plain", 0, 2),
        ("ngram", 2, 2),
        ("dspark", 2, 2),
    ]
    for r in rows:
        assert {"gpu", "date", "commit"} <= r.keys() and r["bench"] == "spec" and r["greedy"]
        assert r["tokens"] == r["num_prompts"] * r["max_tokens"] and r["tokens_per_s"] > 0
        assert r["identical"] == r["num_prompts"]  # speculative greedy output == plain greedy output
        assert 0 < r["first_token_s"] < r["seconds"] and r["decode_tokens_per_s"] > 0
    assert rows[0]["speedup"] == 1.0 and rows[0]["decode_speedup"] == 1.0 and "tau" not in rows[0]
    assert rows[0]["tokens_per_step"] == 2.0  # plain: a token per sequence a step (the prefill samples the first)
    for r in rows[1:]:
        assert r["rounds"] == 0 or 1 <= r["tau"] <= 3 and len(r["acceptance_by_position"]) <= 2
        assert 2 <= r["tokens_per_step"] <= 2 * 3
        assert all(0 <= a <= 1 for a in r["acceptance_by_position"])
    table = capsys.readouterr().out
    assert "acceptance by position" in table and "dspark" in table and "2/2" in table


def test_a_failing_case_is_a_row_with_its_error_and_the_run_goes_on(bench, tmp_path, monkeypatch):
    real = bench.run_case

    def flaky(model_dir, prompts, method, k, batch, drafter, args):
        if method == "ngram":
            raise RuntimeError("no target forward ran")
        return real(model_dir, prompts, method, k, batch, drafter, args)

    monkeypatch.setattr(bench, "run_case", flaky)
    out = tmp_path / "spec.jsonl"
    assert bench.main(["--smoke", "--k", "1", "--batch-sizes", "1", "--num-prompts", "1", "--out", str(out)]) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["method"] for r in rows] == ["plain", "ngram", "dspark"]
    assert rows[1]["error"] == "RuntimeError: no target forward ran" and "tokens_per_s" not in rows[1]
    assert rows[2]["identical"] == 1 and "error" not in rows[2]


def test_cases_run_plain_first_and_skip_dspark_without_a_drafter(bench, capsys):
    args = bench.parse_args(["--smoke", "--methods", "dspark", "ngram", "plain", "--k", "1", "3"])
    assert bench.cases(args, Path("drafter")) == [
        ("plain", 0),
        ("dspark", 1),
        ("dspark", 3),
        ("ngram", 1),
        ("ngram", 3),
    ]
    assert bench.cases(args, None) == [("plain", 0), ("ngram", 1), ("ngram", 3)]
    assert "dspark skipped" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--k", "0"], ["--batch-sizes", "0"], ["--max-tokens", "0"]])
def test_bad_sizes_are_refused(bench, bad):
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", *bad])


def test_heldout_prompts_come_from_documents_outside_the_train_split():
    sys.path.insert(0, str(SCRIPTS))
    demo_prompts = load_script("demo_prompts")
    from kimi_helix.assets import demo_model_dir
    from kimi_helix.tokenizer import load_tokenizer

    train, held = dict(demo_prompts.split_documents("train")), dict(demo_prompts.split_documents("heldout"))
    assert train and held and not train.keys() & held.keys()
    assert len(held) < len(train) / 10  # 5% of the documents are held out
    tokenizer = load_tokenizer(demo_model_dir())
    prompts = demo_prompts.corpus_prompts(tokenizer, "heldout", 4, 16, seed=3)
    assert prompts == demo_prompts.corpus_prompts(tokenizer, "heldout", 4, 16, seed=3)
    assert len(prompts) == 4 and all(len(p) == 16 for p in prompts)
    texts = [tokenizer.decode(p) for p in prompts]
    assert all(any(t in doc for doc in held.values()) for t in texts)
    with pytest.raises(ValueError, match="split must be one of"):
        demo_prompts.split_documents("test")


def test_repeats_alternate_the_cases_and_the_table_shows_medians(bench, tmp_path, capsys):
    out = tmp_path / "spec.jsonl"
    argv = ["--smoke", "--k", "1", "--batch-sizes", "1", "--num-prompts", "1", "--repeats", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["method"], r["repeat"]) for r in rows] == [
        ("plain", 0), ("ngram", 0), ("dspark", 0), ("plain", 1), ("ngram", 1), ("dspark", 1),
    ]  # fmt: skip
    assert all(r["identical"] == 1 for r in rows)  # each run against its own plain run
    assert "medians of 2 runs" in capsys.readouterr().out


def test_median_rows_take_each_cases_medians_and_its_fewest_identical(bench):
    def run(method, tokens_per_s, identical, **extra):
        return dict(method=method, k=5, batch_size=1, tokens_per_s=tokens_per_s, speedup=tokens_per_s / 10,
                    identical=identical, ms_per_round=100 / tokens_per_s, **extra)  # fmt: skip

    rows = [run("dspark", 12.0, 8), run("dspark", 30.0, 7), run("dspark", 18.0, 8),
            dict(method="dspark", k=5, batch_size=1, error="boom"), run("ngram", 11.0, 8)]  # fmt: skip
    medians = {r["method"]: r for r in bench.median_rows(rows)}
    assert medians["dspark"]["tokens_per_s"] == 18.0 and medians["dspark"]["speedup"] == 1.8
    assert medians["dspark"]["ms_per_round"] == 100 / 18.0 and medians["dspark"]["identical"] == 7
    assert medians["ngram"]["tokens_per_s"] == 11.0 and "error" not in medians["dspark"]
    assert bench.median_rows([dict(method="plain", k=0, batch_size=1, error="boom")])[0]["error"] == "boom"
