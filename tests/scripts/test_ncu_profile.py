"""scripts/ncu_profile.py's readers of Nsight Compute exports, on excerpts laid out as ncu 2025.3 writes them (the
profiling itself needs a GPU and ncu)."""

from __future__ import annotations

import json

import pytest

from .conftest import load_script

ncu = load_script("ncu_profile")

TEXT = """[502] python3.12@127.0.0.1
  kda_chunk_gate_kernel (128, 64, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Elapsed Cycles                cycle      264,029
    DRAM Throughput                   %        77.95
    Duration                         us       137.09
    Issued Warp Per Scheduler                                  0.35
    Warp Cycles Per Issued Instruction             cycle         8.39
    Issued Warp Per Scheduler                                  0.99
    Stall Long Scoreboard           inst         4.04
    Stall Wait                      inst         0.92
    Stall Barrier                   inst         0.81
    Registers Per Thread             register/thread             158
    Dynamic Shared Memory Per Block      Kbyte/block           32.77
    Achieved Occupancy                             %           18.14
  mla_decode_fwd_kernel (1280, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    DRAM Throughput                   %        26.82
    Duration                         ms         1.07
    Stall Barrier                   inst         2.42
    Stall Long Scoreboard           inst         1.95
    Dynamic Shared Memory Per Block       byte/block          512
"""

_HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"'
)
CSV = "\n".join([
    '"Kernel Name","kda_chunk_gate_kernel",', _HEADER,
    '"0x10","  LDG.E R1, desc[UR6][R2.64]","10","2","8","9"',
    '"0x20","  PRMT R152, R221, 0x5410, R222","30","25","5","1"',
    '"0x30","  EXIT","0","0","0","0"',
    '"Kernel Name","mla_decode_fwd_kernel",', _HEADER,
    '"0x10","  WARPSYNC.ALL","4","4","0","0"',
])  # fmt: skip


def test_summaries_read_each_kernel_block():
    gate, mla = ncu.summaries(TEXT)
    assert (gate["kernel"], gate["grid"], gate["block"]) == ("kda_chunk_gate_kernel", "128, 64, 1", "128, 1, 1")
    assert gate["duration_us"] == 137.09 and gate["dram_pct"] == 77.95
    assert gate["issued_warp_per_scheduler"] == 0.35  # a metric without a unit; its first row
    assert gate["warp_cycles_per_issued_instruction"] == 8.39 and gate["registers"] == 158
    assert gate["dynamic_smem_kb"] == 32.77 and gate["achieved_occupancy_pct"] == 18.14
    assert list(gate["stall_cycles_per_instruction"].items()) == [
        ("Long Scoreboard", 4.04), ("Wait", 0.92), ("Barrier", 0.81)
    ]  # fmt: skip
    assert mla["duration_us"] == pytest.approx(1070.0) and mla["dynamic_smem_kb"] == pytest.approx(0.512)
    assert mla["registers"] is None  # not in that block, and not taken from another kernel's
    assert list(mla["stall_cycles_per_instruction"]) == ["Barrier", "Long Scoreboard"]


def test_hottest_ranks_sass_lines_by_stall_samples():
    gate, mla = ncu.hottest(CSV, n=2)
    assert gate == [
        dict(sass="PRMT R152, R221, 0x5410, R222", share=0.75, stall="long_sb"),
        dict(sass="LDG.E R1, desc[UR6][R2.64]", share=0.25, stall="wait"),  # not-issued counts do not vote
    ]
    assert mla == [dict(sass="WARPSYNC.ALL", share=1.0, stall="long_sb")]


def test_summarise_labels_launches_and_checks_their_count(tmp_path, monkeypatch):
    (tmp_path / "x.txt").write_text(TEXT)
    (tmp_path / "x_sass.csv").write_text(CSV)
    meta = {"gpu": "NVIDIA H200", "date": "2026-12-01T23:56:00+00:00", "commit": "abc1234"}
    (tmp_path / "x.meta.json").write_text(json.dumps(meta))
    monkeypatch.setitem(ncu.TARGETS, "x", dict(kernels="", skip=0, labels=["gate case", None]))
    (row,) = ncu.summarise("x", tmp_path)
    assert row["case"] == "gate case" and row["kernel"] == "kda_chunk_gate_kernel"
    assert {k: row[k] for k in meta} == meta and row["hottest_instructions"][0]["share"] == 0.75
    monkeypatch.setitem(ncu.TARGETS, "x", dict(kernels="", skip=0, labels=["a", "b", "c"]))
    with pytest.raises(ValueError, match="expected 3"):
        ncu.summarise("x", tmp_path)


def test_main_appends_rows_and_keeps_a_saved_report(tmp_path, monkeypatch):
    (tmp_path / "x.txt").write_text(TEXT)
    (tmp_path / "x_sass.csv").write_text(CSV)
    (tmp_path / "x.meta.json").write_text(json.dumps({"gpu": "g", "date": "d", "commit": "c"}))
    monkeypatch.setitem(ncu.TARGETS, "x", dict(kernels="", skip=0, labels=["a", "b"]))
    for _ in range(2):
        ncu.main(["--target", "x", "--out", str(tmp_path), "--from-exports"])
    rows = [json.loads(line) for line in (tmp_path / "ncu_x.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == ["a", "b", "a", "b"]
    (tmp_path / "x.ncu-rep").write_bytes(b"saved")
    with pytest.raises(SystemExit):  # refused before ncu is looked for
        ncu.main(["--target", "x", "--out", str(tmp_path)])
    assert (tmp_path / "x.ncu-rep").read_bytes() == b"saved"
