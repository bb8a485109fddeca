"""Smoke test of scripts/tune_mla_decode.py: it runs on the CPU and writes well-formed JSONL."""

from __future__ import annotations

import os

import pytest

from kimi_helix.kernels.mla import decode


@pytest.mark.parametrize("tma", [False, True])
def test_tune_smoke(tmp_path, tma):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    try:
        import tune_mla_decode
    finally:
        sys.path.pop(0)
    committed = dict(decode.SCHEDULES), decode.MIN_WAVES
    tune_mla_decode.main(["--smoke", "--out", str(tmp_path), *(["--tma"] if tma else [])])
    rows = [json.loads(line) for line in (tmp_path / "tune_mla_decode.jsonl").read_text().splitlines()]
    assert rows and all(r["error"] is None and r["ms"] > 0 for r in rows), rows
    assert {r["min_waves"] for r in rows} == {1, 2, 4, 8}
    # the sweep times the committed schedule too, and leaves the module as it found it
    assert [*tune_mla_decode.DEFAULTS[tuple(rows[0]["key"])]] in [r["schedule"] for r in rows]
    assert any(decode.Schedule(*r["schedule"]).tma == tma for r in rows)  # TMA candidates exactly with --tma
    assert {decode.Schedule(*r["schedule"]).d_split for r in rows} == set(decode.D_SPLITS)
    assert (dict(decode.SCHEDULES), decode.MIN_WAVES) == committed


def test_tune_cases_are_checked():
    import argparse
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    try:
        import tune_mla_decode
    finally:
        sys.path.pop(0)
    assert tune_mla_decode.parse_case("128,16,4,8192,fp8") == (128, 16, 4, 8192, "fp8")
    for bad in ("128,16", "128,16,1,8192,int8", "128,0,1,8192,bf16", "a,16,1,8192,bf16"):
        with pytest.raises(argparse.ArgumentTypeError, match="b,h,s_q,s_k,kv"):
            tune_mla_decode.parse_case(bad)
    assert tune_mla_decode.parse_schedule("64,8,5,0,1,tma") == decode.Schedule(64, 8, 5, 0.0, tma=True)
    for bad in ("64,8,5", "64,8,5,0,3", "64,8,5,0,1,fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="block_n|d_split"):
            tune_mla_decode.parse_schedule(bad)
