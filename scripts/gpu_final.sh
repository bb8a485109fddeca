#!/bin/bash
# The closing GPU run of a session, in one device call: the step limits add up to 540 s (the tool allows 600):
#   1. the carried wheels (fla) into /tmp/site;
#   2. the 27-layer e2e grid with transformers' KimiLinear, most important cases first, --budget-s 205, each decode
#      and verify row with its 30 kernels of most GPU time;
#   3. fp8 against bf16 MLA decode (b = 1 and 128, 16 heads, 8k keys);
#   4. the GPU tests in four groups (the prefill's conv, MoE and KDA kernels; fp8 MLA decode; speculative decoding
#      and the engine's CUDA graphs; an asynchronous round's acceptance and rollback kernels);
#   5. with --spec, the speculative benchmark (plain and DSpark at k = 5, batch 1, three alternating runs; 95 s);
#   6. a summary.
# Every step runs under `timeout` (pytest under SIGINT, so that it still prints its summary) and writes under $OUT
# as it goes, so a step cut short keeps what it finished. Files back (the tool returns at most 8): run.log,
# e2e.jsonl, mla_decode.jsonl, summary.txt, and spec.jsonl with --spec.
# usage: bash scripts/gpu_final.sh COMMIT [--no-tests] [--no-e2e] [--spec]   (the device copy has no .git: the commit
# goes into every row; --no-tests leaves out step 4, 220 s, for a call with less device time left; --no-e2e leaves
# out step 2, for an H100, where the 27 layers' bf16 weights do not fit)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KIMI_HELIX_COMMIT=${1:-unknown} OUT=${OUT:-out}
tests=1 e2e=1 spec=0
for flag in "${@:2}"; do
  case $flag in
    --no-tests) tests=0 ;;
    --no-e2e) e2e=0 ;;
    --spec) spec=1 ;;
    *) echo "unknown flag $flag (allowed: --no-tests, --no-e2e, --spec)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
log="$OUT/run.log"
summary="$OUT/summary.txt"

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log it, note its status and duration
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit}s)" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s (limit $limit)" | tee -a "$log" >> "$summary"
}

if compgen -G ".whl/*.whl" > /dev/null; then
  step wheels 30 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site

if ((e2e)); then
  step e2e 235 python3 scripts/bench_e2e.py --budget-s 205 --top-kernels 30 --out "$OUT/e2e.jsonl"
fi
step mla-fp8 40 python3 scripts/bench_mla.py --b 1 128 --h 16 --s-q 1 --s-k 8192 --kv bf16 fp8 \
  --backends triton --out "$OUT"
if ((tests)); then
  step tests-prefill-kernels 80 timeout -s INT 75 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/conv tests/kernels/moe tests/kernels/kda/test_gpu.py
  step tests-mla-fp8 45 timeout -s INT 40 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/mla/test_gpu.py -k fp8
  step tests-speculative-engine 65 timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/speculative tests/engine/test_cuda_graph.py
  # not gpu-marked: on a GPU they run the compiled kernels (tests/kernels/conftest.py's DEVICE)
  step tests-round-kernels 30 timeout -s INT 25 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/kernels/state_restore tests/kernels/accept_stage
fi
if ((spec)); then
  step spec 95 python3 scripts/bench_spec.py --methods plain dspark --k 5 --batch-sizes 1 --repeats 3 \
    --out "$OUT/spec.jsonl"
fi

{
  echo "--- e2e rows (phase batch context mode ms_per_step pct_of_floor speedup_vs_hf skipped/failed)"
  python3 - "$OUT/e2e.jsonl" << 'EOF'
import json, sys
from pathlib import Path
for line in Path(sys.argv[1]).read_text().splitlines() if Path(sys.argv[1]).exists() else []:
    r = json.loads(line)
    note = r.get("skipped") or r.get("failed") or ""
    print(r["phase"], r["batch"], r["context"], r.get("mode"), r.get("ms_per_step"), r.get("pct_of_floor"),
          r.get("speedup_vs_hf") or r.get("verify_over_decode") or "", note[:100])
EOF
  echo "--- pytest summaries"
  grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$log" | tail -n 20
} >> "$summary" 2>&1
cat "$summary"
