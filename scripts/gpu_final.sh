#!/bin/bash
# The closing GPU run of a session in one device call (every step bounded; each writes under $OUT as it goes):
# end-to-end decode at 27 layers with transformers, the demo drafter's training and the speculative benchmark,
# the one-GPU Helix baseline and the engine's GPU parity test.   usage: bash scripts/gpu_final.sh COMMIT
# Everything logs into one file: the device tool returns at most eight files, and the drafter is two of them.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KIMI_HELIX_COMMIT=$1 OUT=${OUT:-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
timeout 120 python3 scripts/bench_e2e.py --batches 1,64 --contexts 4096 --no-prefill --top-kernels 30 \
  --out "$OUT/e2e.jsonl" >> "$OUT/run.log" 2>&1
timeout 160 python3 scripts/train_drafter.py --out "$OUT/drafter" --ckpt-dir /tmp/drafter-ckpt --max-minutes 2.3 \
  >> "$OUT/run.log" 2>&1
timeout 50 python3 scripts/bench_spec.py --drafter "$OUT/drafter" --methods plain ngram dspark --k 5 \
  --batch-sizes 1 --out "$OUT/spec.jsonl" >> "$OUT/run.log" 2>&1
timeout 45 python3 scripts/bench_helix.py --cp 1 --contexts 32768,131072 --batches 1 --out "$OUT/helix.jsonl" \
  >> "$OUT/run.log" 2>&1
timeout 60 python3 -m pytest -q -x -m gpu tests/engine/test_llm_gpu.py tests/kernels/linear >> "$OUT/run.log" 2>&1
tail -n 40 "$OUT/run.log"
