"""Nsight Compute profile of the Triton kernels on a GPU, summarised as JSON lines.

    python scripts/ncu_profile.py --target kda --out $OUT   # chunk_kda at T=8192, H=64, bf16, g given (4 kernels)
    python scripts/ncu_profile.py --target mla --out $OUT   # MLA decode, b=128, s_k=8192, bf16: H=16, H=128, H=32 s_q=4
    python scripts/ncu_profile.py --target mla_fp8 --out $OUT   # MLA decode, b=128, s_k=8192, fp8 cache, H=16
    python scripts/ncu_profile.py --target kda --out DIR --from-exports   # summarise DIR's exports again, no GPU

The workload runs under ``ncu --clock-control none`` (the clocks stay as the machine sets them); the report is
exported as text (``<target>.txt``: every section) and as per-SASS-line source counters (``<target>_sass.csv``).
One JSON object per profiled kernel is appended to ``<out>/ncu_<target>.jsonl``: duration, DRAM throughput, issue rate,
occupancy, registers, shared memory, the largest stall reasons (cycles an issued instruction) and the SASS lines
holding the most stall samples. Needs ``ncu`` on the PATH and a GPU whose counters it can read (the lent H200).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import JsonlWriter, run_metadata  # noqa: E402

# Kernels profiled per target (a regex for ncu -k), how many launches to skip (warm-up calls), and a label per
# profiled launch, in launch order (None: profiled but not summarised, a repeat of the case before); as many
# launches are profiled as there are labels.
TARGETS = {
    "kda": dict(kernels="kda_chunk_(gate|intra_kernel|wy|state)", skip=4,
                labels=["chunk_kda T=8192 H=64 K=V=128 bf16, g given"] * 4),
    # H=128 and H=32 s_q=4 (64 tile rows) run the Gluon kernel on sm_90, H=16 the Triton one.
    "mla": dict(kernels="mla_decode_(fwd|wgmma)_kernel", skip=0,
                labels=[c if i == 0 else None for c in ("mla_decode b=128 s_k=8192 bf16 H=16 s_q=1",
                                                        "mla_decode b=128 s_k=8192 bf16 H=128 s_q=1",
                                                        "mla_decode b=128 s_k=8192 bf16 H=32 s_q=4")
                        for i in range(3)]),
    # The fp8 cache at 16 heads runs the warp-specialised Gluon kernel (`decode_fp8_wgmma`) on sm_90.
    "mla_fp8": dict(kernels="mla_decode_fp8_wgmma_kernel", skip=2,
                    labels=["mla_decode b=128 s_k=8192 fp8 H=16 s_q=1"]),
}  # fmt: skip
SECTIONS = ["SpeedOfLight", "WarpStateStats", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "SchedulerStats",
            "ComputeWorkloadAnalysis", "SourceCounters"]  # fmt: skip
METRICS = {  # summary field: the metric's name in the text export (its first occurrence in a kernel's block)
    "duration_us": "Duration",
    "dram_pct": "DRAM Throughput",
    "issued_warp_per_scheduler": "Issued Warp Per Scheduler",
    "warp_cycles_per_issued_instruction": "Warp Cycles Per Issued Instruction",
    "achieved_occupancy_pct": "Achieved Occupancy",
    "registers": "Registers Per Thread",
    "dynamic_smem_kb": "Dynamic Shared Memory Per Block",
}
_STALL = re.compile(r"^\s*Stall (\w[\w ]*?)\s{2,}inst\s+([\d.]+)\s*$", re.M)  # "Stall Wait   inst   1.94"
_SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "byte/block": 1e-3, "Kbyte/block": 1.0}


def workload(target: str) -> None:
    """The calls ncu profiles: three of each case, so the warm-up (compilation) can be skipped."""
    dev = torch.device("cuda")
    if target == "kda":
        from bench_kda import prefill_inputs

        from kimi_helix.kernels.kda.chunk import chunk_kda_triton

        x = prefill_inputs(8192, 64, 128, torch.bfloat16, dev)
        for _ in range(3):
            chunk_kda_triton(
                x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, use_qk_l2norm_in_kernel=True
            )
    else:
        from bench_mla import KV_LORA, ROPE, Cache

        from kimi_helix.kernels.mla.decode import mla_decode_triton

        fp8 = target == "mla_fp8"
        cache = Cache(128, 8192, "fp8" if fp8 else "bf16", dev, torch.bfloat16)
        for h, s_q in ((16, 1),) if fp8 else ((16, 1), (128, 1), (32, 4)):
            T = 128 * s_q
            q = torch.randn(T, h, KV_LORA + ROPE, device=dev, dtype=torch.bfloat16)
            cu = torch.arange(0, T + 1, s_q, dtype=torch.int32, device=dev)
            for i in range(3):
                table = cache.tables[i % len(cache.tables)]
                mla_decode_triton(q, cache.kv, table, cache.lens, cu, 192**-0.5, KV_LORA, None, cache.scale)
    torch.cuda.synchronize()


def profile(target: str, out: Path) -> None:
    """Runs the target's workload under ncu and exports its report to out/<target>.txt and out/<target>_sass.csv,
    with the run's metadata (gpu, date, commit) in out/<target>.meta.json."""
    t = TARGETS[target]
    (out / f"{target}.meta.json").write_text(json.dumps(run_metadata()))
    report = out / f"{target}.ncu-rep"
    sections = [a for s in SECTIONS for a in ("--section", s)]
    launches = ["--launch-skip", str(t["skip"]), "--launch-count", str(len(t["labels"]))]
    subprocess.run(["ncu", "--clock-control", "none", "-f", "-k", f"regex:{t['kernels']}", *launches, *sections,
                    "-o", str(report.with_suffix("")), sys.executable, __file__, "--workload", target],
                   check=True)  # fmt: skip
    for args, name in ((["--print-details", "all"], f"{target}.txt"),
                       (["--page", "source", "--csv", "--print-source", "sass"], f"{target}_sass.csv")):  # fmt: skip
        text = subprocess.run(["ncu", "--import", str(report), *args], check=True, capture_output=True, text=True)
        (out / name).write_text(text.stdout)


def _metric(block: str, name: str) -> float | None:
    """The value of the first `name` row of a kernel's text block ("name [unit] value", columns 2+ spaces apart)."""
    for line in block.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == name and len(cells) in (2, 3):
            value = float(cells[-1].replace(",", ""))
            return value * _SCALE.get(cells[1], 1.0) if len(cells) == 3 else value
    return None


def summaries(text: str) -> list[dict]:
    """Per kernel launch of a ``--print-details all`` export: the METRICS and the six largest stall reasons."""
    rows = []
    for block in re.split(r"\n  (?=\w+ \([\d, ]+\)x\([\d, ]+\))", text)[1:]:
        head = re.match(r"(\w+) \(([\d, ]+)\)x\(([\d, ]+)\)", block)
        stalls = {m[1]: float(m[2]) for m in _STALL.finditer(block)}
        largest = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
        rows.append(dict(kernel=head[1], grid=head[2], block=head[3],
                         **{field: _metric(block, name) for field, name in METRICS.items()},
                         stall_cycles_per_instruction=largest))  # fmt: skip
    return rows


def hottest(source_csv: str, n: int = 6) -> list[list[dict]]:
    """Per kernel launch of a ``--page source --csv`` export: the n SASS lines with the most stall samples, each with
    its share of the kernel's samples and the stall reason that dominates it."""
    lines = source_csv.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')] + [len(lines)]
    out = []
    for a, b in zip(starts, starts[1:]):
        rows = list(csv.DictReader(io.StringIO("\n".join(lines[a + 1 : b]))))
        samples = [float(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows]
        reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        top = sorted(range(len(rows)), key=lambda i: -samples[i])[:n]
        out.append([dict(sass=" ".join(rows[i]["Source"].split()), share=round(samples[i] / sum(samples), 3),
                         stall=max(reasons, key=lambda c: float(rows[i][c] or 0)).removeprefix("stall_"))
                    for i in top])  # fmt: skip
    return out


def summarise(target: str, out: Path) -> list[dict]:
    """JSON rows for the labelled launches of out/<target>.txt and out/<target>_sass.csv, with the metadata of the
    run that profiled them (out/<target>.meta.json)."""
    labels = TARGETS[target]["labels"]
    kernels = summaries((out / f"{target}.txt").read_text())
    hot = hottest((out / f"{target}_sass.csv").read_text())
    if len(kernels) != len(labels) or len(hot) != len(labels):
        raise ValueError(f"{target}: {len(kernels)} kernels in the text export, {len(hot)} in the source export, "
                         f"expected {len(labels)}")  # fmt: skip
    meta = dict(json.loads((out / f"{target}.meta.json").read_text()), tool="ncu --clock-control none")
    return [dict(meta, case=label, **k, hottest_instructions=h)
            for label, k, h in zip(labels, kernels, hot) if label is not None]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=list(TARGETS))
    p.add_argument("--out", type=Path, help="directory for the report, its exports and ncu_<target>.jsonl")
    p.add_argument("--from-exports", action="store_true", help="summarise the exports already in --out")
    p.add_argument("--force", action="store_true", help="profile again over a report already in --out")
    p.add_argument("--workload", choices=list(TARGETS), help=argparse.SUPPRESS)  # what ncu runs
    args = p.parse_args(argv)
    if args.workload:
        workload(args.workload)
        return []
    if args.target is None or args.out is None:
        p.error("--target and --out are required")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.from_exports:
        report = args.out / f"{args.target}.ncu-rep"
        if report.exists() and not args.force:
            p.error(f"{report} exists; pass --force to profile again over it (or --from-exports to reuse it)")
        profile(args.target, args.out)
    rows = summarise(args.target, args.out)
    with JsonlWriter(args.out / f"ncu_{args.target}.jsonl") as results:
        for row in rows:
            results.write(row)
    for r in rows:
        stalls = ", ".join(f"{k} {v}" for k, v in list(r["stall_cycles_per_instruction"].items())[:3])
        print(f"{r['kernel']:28s} {r['duration_us']:8.1f} us  DRAM {r['dram_pct']:5.1f}%  {stalls}")
    return rows


if __name__ == "__main__":
    main()
