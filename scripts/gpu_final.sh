#!/bin/bash
# The closing GPU run of a session in one device call (every step bounded; each writes under $OUT as it goes):
# the 27-layer e2e grid, the speculative benchmark, fp8 against bf16 MLA decode, then the GPU tests in groups.
# usage: bash scripts/gpu_final.sh COMMIT   (the device copy's git does not know the commit)
# Everything logs into one file: the device tool returns at most eight files.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KIMI_HELIX_COMMIT=$1 OUT=${OUT:-out}
mkdir -p "$OUT"
log="$OUT/run.log"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
timeout 270 python3 scripts/bench_e2e.py --no-hf --verify-k 4 --top-kernels 30 --out "$OUT/e2e.jsonl" >> "$log" 2>&1
timeout 80 python3 scripts/bench_spec.py --methods plain ngram dspark --k 5 --batch-sizes 1 --out "$OUT/spec.jsonl" \
  >> "$log" 2>&1
timeout 50 python3 scripts/bench_mla.py --b 1 128 --h 16 --s-q 1 --s-k 8192 --kv bf16 fp8 --backends triton \
  --out "$OUT" >> "$log" 2>&1
# SIGINT, so that pytest prints its summary when a group runs out of time
timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/kernels tests/modeling >> "$log" 2>&1
timeout -s INT 80 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/engine tests/speculative >> "$log" 2>&1
tail -n 40 "$log"
