#!/usr/bin/env bash
# GPU parity run for the device machine: the `gpu`-marked tests (bf16 at real shapes) with a log under $OUT.
# Usage (from the repo root, on a CUDA machine): bash scripts/gpu_check.sh [extra pytest args]
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m gpu -q -rA -p no:cacheprovider "$@" tests 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
