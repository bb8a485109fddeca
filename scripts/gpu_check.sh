#!/usr/bin/env bash
# One device-machine session: the `gpu`-marked tests (bf16 at real shapes), then the benchmarks, each under its
# own time limit so one slow step cannot eat the call. Logs and JSONL land in $OUT (default ./out).
#
#   KIMI_HELIX_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh [tests|bench|all] [pytest args...]
#
# The device machine has no .git: pass the commit of the tree you send so the JSONL records it.
set -uo pipefail
mode="${1:-all}"
[ $# -gt 0 ] && shift
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$out/gpu.txt"

if [ "$mode" = tests ] || [ "$mode" = all ]; then
    timeout "${TEST_LIMIT:-240}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=15 "$@" tests \
        > "$out/gpu_check.log" 2>&1
    echo "pytest rc=$?" | tee -a "$out/gpu_check.log"
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
    log="$out/bench.log"
    step() { local limit=$1; shift; timeout "$limit" python3 "$@" >> "$log" 2>&1; echo "$* rc=$?" >> "$log"; }
    step 60 scripts/bench_kda_prefill.py --out "$out" --T 8192 --H 64
    step 60 scripts/bench_kda_decode.py --out "$out"
    step 120 scripts/bench_mla.py --out "$out" --quick
    step 60 scripts/bench_moe.py --out "$out" --tokens 1 16 128 4096
    step 60 scripts/bench_mla_prefill.py --out "$out/mla_prefill.jsonl" --heads 32 64
    grep " rc=" "$log"
fi
