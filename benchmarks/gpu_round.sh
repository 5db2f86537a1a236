#!/usr/bin/env bash
# One device call after kernel changes: the GPU tests of the changed parts, the kernel sweeps, then workloads.
# usage: BENCH='"W1 --shape qwen3-0.6b" ...' [SWEEP=0] bash benchmarks/gpu_round.sh [TEST FILES...]. Logs in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "--- $1 ($(( $(date +%s) - T0 )) s)"; }
stamp "GPU tests"
timeout 200 python3 -m pytest -q -x "${@:-tests/kernels/test_fused_kernels.py}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
if [ "${SWEEP:-1}" = 1 ]; then
  stamp "decode sweep"
  timeout 200 python3 -m benchmarks.attention_kernels --sweep-decode 2>&1 | tee "$OUT/decode_sweep.log" | grep -v '^  ('
fi
stamp "workloads"
eval "LIMIT=150 bash benchmarks/gpu_bench.sh $BENCH" | tail -8
stamp "done"
