#!/usr/bin/env bash
# Device-machine steps: the `gpu`-marked tests (bf16 at real shapes) and the benchmarks, each under its own time
# limit so one slow step cannot eat the call. Logs and JSONL land in $OUT (default ./out). One mode fits one
# 10-minute device call: `tests kda` in one, `mla` in the next.
#
#   KIMI_HELIX_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh tests|kda|mla|spec|tune|ncu|all [pytest args...]
#
# `spec` times speculative decoding on the demo model at batch 1 (plain against DSpark k = 5 and 7, three runs
# each), profiles a round (scripts/profile_round.py, also with the KDA recurrent kernel at four warps), then runs the
# `gpu`-marked tests of the round's code (spec.jsonl and logs in $OUT); it fits one call with a cold Triton cache.
#
# `tune` sweeps the KDA prefill's launch tables at T=8192, H=64 (scripts/tune_kda_prefill.py), for the given
# decay and for the bounded (K3) gate; `ncu` profiles the KDA prefill and MLA decode kernels with Nsight Compute
# (scripts/ncu_profile.py). Neither is part of `all`.
#
# The device machine has no .git: pass the commit of the tree you send so the JSONL records it. With PACK=1 the
# outputs end up as one archive, $OUT/gpu_check.tgz, for a device tool that returns only a few files per call.
set -uo pipefail
mode="${1:-all}"
[ $# -gt 0 ] && shift
case "$mode" in
    tests | kda | mla | spec | tune | ncu | all) ;;
    *) echo "gpu_check.sh: unknown mode '$mode' (allowed: tests, kda, mla, spec, tune, ncu, all)" >&2; exit 2 ;;
esac
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$out/gpu.txt"

if [ "$mode" = tests ] || [ "$mode" = all ]; then
    timeout "${TEST_LIMIT:-420}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=15 "$@" tests \
        > "$out/gpu_check.log" 2>&1
    echo "pytest rc=$?" | tee -a "$out/gpu_check.log"
fi
log="$out/bench.log"
step() { local limit=$1; shift; timeout "$limit" python3 "$@" >> "$log" 2>&1; echo "$* rc=$?" | tee -a "$log"; }
if [ "$mode" = kda ] || [ "$mode" = all ]; then
    # most of this is compiling and fla's autotuning: the T=8192 grid alone ran past 210 s cold (run 7)
    step 420 scripts/bench_kda.py --out "$out" --phase prefill --breakdown
    step 40 scripts/bench_kda.py --out "$out" --phase decode
fi
if [ "$mode" = mla ] || [ "$mode" = all ]; then
    step 300 scripts/bench_mla.py --out "$out"
    step 70 scripts/bench_moe.py --out "$out" --tokens 1 16 128 4096
fi
if [ "$mode" = spec ]; then
    step 210 scripts/bench_spec.py --methods plain dspark --k 5 7 --batch-sizes 1 --repeats 3 --out "$out/spec.jsonl"
    timeout 80 python3 scripts/profile_round.py > "$out/profile.log" 2>&1
    echo "profile_round rc=$?" | tee -a "$log"
    timeout 60 python3 scripts/profile_round.py --kda-warps 4 > "$out/profile_kda_warps4.log" 2>&1
    echo "profile_round --kda-warps 4 rc=$?" | tee -a "$log"
    # most of the tests' time is compiling (docs/benchmarks.md, "GPU parity")
    timeout 270 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/speculative tests/engine/test_cuda_graph.py \
        tests/kernels/router tests/kernels/conv tests/kernels/norm > "$out/gpu_check.log" 2>&1
    echo "pytest rc=$?" | tee -a "$out/gpu_check.log"
fi
if [ "$mode" = tune ]; then
    # the given decay's tables first (the per-half and block kernels take the chunks too wide for the chunk-wide
    # one there); the bounded gate's intra table after, with WY (shared by both)
    step 300 scripts/tune_kda_prefill.py --out "$out" --tables INTRA HALVES BLOCKS
    step 240 scripts/tune_kda_prefill.py --out "$out" --lower-bound -5 --tables INTRA_BOUNDED WY
fi
if [ "$mode" = ncu ]; then
    step 200 scripts/ncu_profile.py --target kda --out "$out/ncu" --force
    step 200 scripts/ncu_profile.py --target mla --out "$out/ncu" --force
fi
if [ "${PACK:-0}" = 1 ]; then
    packed="$(mktemp -d)/gpu_check.tgz"
    tar -czf "$packed" -C "$out" . && find "$out" -mindepth 1 -delete && mv "$packed" "$out/"
    echo "packed into $out/gpu_check.tgz"
fi
