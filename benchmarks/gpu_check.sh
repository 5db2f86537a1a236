#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests, then the kernel benchmark. Logs land in $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -m pytest -q -x tests/kernels/test_triton_kernels.py tests/engine/test_gpu_e2e.py "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
python3 -m benchmarks.attention_kernels 2>&1 | tee "$OUT/attention_kernels.log" | tail -40
