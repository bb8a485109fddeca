#!/usr/bin/env bash
# A/B of end-to-end step times between an earlier commit's package and this tree's, in one device call, both timed
# by this tree's scripts/bench_e2e.py (the script only drives and reports: the package under test is whichever
# kimi_helix comes first on PYTHONPATH). Runs alternate, so drift in clocks or temperature falls on both sides.
#
#   here:   bash scripts/ab_e2e.sh pack REV
#           writes $AB_DIR/REV.tgz (default .ab/, git-ignored: the device call names it in carry), kimi_helix at
#           REV without its demo assets (about 250 KB)
#   device: bash scripts/ab_e2e.sh run REV HEAD_COMMIT [ROUNDS] [-- BENCH_ARGS...]
#           ROUNDS (default 2) runs of each side; rows to $OUT/ab_REV.jsonl and $OUT/ab_HEAD_COMMIT.jsonl, their
#           median ms a step per case to $OUT/ab_summary.txt. BENCH_ARGS default to the batch-64 verify case at
#           4k context on 6 layers, with its 25 kernels of most GPU time.
set -uo pipefail
usage="usage: ab_e2e.sh pack REV | ab_e2e.sh run REV HEAD_COMMIT [ROUNDS] [-- BENCH_ARGS...]"
cd "$(dirname "$0")/.."
mode=${1:-} packs=${AB_DIR:-.ab}
case $mode in
  pack)
    rev=${2:?$usage}
    mkdir -p "$packs"
    git archive --format=tar.gz -o "$packs/$rev.tgz" "$rev" -- kimi_helix ':(exclude)kimi_helix/assets'
    ls -l "$packs/$rev.tgz"
    ;;
  run)
    rev=${2:?$usage} head=${3:?$usage} rounds=2
    shift 3
    if [ $# -gt 0 ] && [ "$1" != -- ]; then rounds=$1; shift; fi
    [[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
    [ "${1:-}" = -- ] && shift
    bench=("$@")
    ((${#bench[@]})) || bench=(--layers 6 --batches 64 --contexts 4096 --verify-batches 64 --no-hf --no-prefill
                               --top-kernels 25)
    [ -f "$packs/$rev.tgz" ] || { echo "no $packs/$rev.tgz: run 'ab_e2e.sh pack $rev' here and carry it" >&2; exit 2; }
    out=${OUT:-out} base=$(mktemp -d)
    mkdir -p "$out"
    tar -xzf "$packs/$rev.tgz" -C "$base"
    export PYTHONUNBUFFERED=1
    pythonpath=${PYTHONPATH:-}  # the carried wheels' site, say
    with_package() { PYTHONPATH="$1${pythonpath:+:$pythonpath}" "${@:2}"; }  # ROOT COMMAND...: ROOT's package first
    sides=("$rev:$base" "$head:$PWD")
    for side in "${sides[@]}"; do  # each side must import its own package, not one installed or in the cwd
      root=${side#*:}
      pkg=$(cd / && with_package "$root" python3 -c 'import kimi_helix; print(kimi_helix.__path__[0])')
      [ "$pkg" = "$root/kimi_helix" ] || { echo "kimi_helix imports from $pkg, not $root" >&2; exit 2; }
    done
    for ((i = 1; i <= rounds; i++)); do
      for side in "${sides[@]}"; do
        commit=${side%%:*} root=${side#*:}
        echo "=== round $i: $commit, kimi_helix from $root"
        KIMI_HELIX_COMMIT=$commit with_package "$root" python3 scripts/bench_e2e.py "${bench[@]}" \
          --out "$out/ab_$commit.jsonl"
      done
    done 2>&1 | tee "$out/ab.log"
    python3 - "$out" "$rev" "$head" << 'EOF' | tee "$out/ab_summary.txt"
import json, statistics, sys
from pathlib import Path

out, sides = Path(sys.argv[1]), sys.argv[2:]
times = {}  # (phase, batch, context) -> side -> [ms]
for side in sides:
    path = out / f"ab_{side}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        if row.get("ms_per_step") is not None:
            case = (row["phase"], row["batch"], row["context"])
            times.setdefault(case, {}).setdefault(side, []).append(row["ms_per_step"])
print("phase batch context", *(f"{s} (median ms)" for s in sides), "ratio")
for case, by_side in sorted(times.items()):
    medians = [statistics.median(by_side[s]) if s in by_side else None for s in sides]
    ratio = f"{medians[1] / medians[0]:.3f}" if None not in medians else ""
    print(*case, *("-" if m is None else f"{m:.3f}" for m in medians), ratio)
EOF
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
