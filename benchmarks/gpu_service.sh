#!/usr/bin/env bash
# One device call for the service work (#54): the GPU engine tests and the serving lifecycle tests on CUDA workers
# (worker secret handshake, drain, exits, bounded bodies), then W1 Qwen3-0.6B on this tree and on BASE (a
# `git archive` tarball of an earlier commit, carried in .whl/) in the same call. Logs land in $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; BASE=${BASE:-.whl/base.tar.gz}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -n 4 -m gpu tests/engine 2>&1 | tee "$OUT/gpu_engine.log" | tail -4
python3 -m pytest -q -n 4 tests/serving/test_lifecycle.py tests/serving/test_drain.py tests/serving/test_openai_shutdown_aborts.py \
    tests/serving/test_openai_admission.py tests/protocol/test_worker_handshake.py tests/serving/test_faults.py 2>&1 \
    | tee "$OUT/serving.log" | tail -4
w1() { timeout 200 python3 -m benchmarks.throughput --workload W1 --shape qwen3-0.6b 2>&1 | tail -1 | cut -c1-160; }
echo "W1 this tree: $(w1)"
if [ -f "$BASE" ]; then
  mkdir -p /tmp/base && tar xzf "$BASE" -C /tmp/base && (cd /tmp/base && export PYTHONPATH=/tmp/site:/tmp/base && echo "W1 base: $(w1)")
  echo "W1 this tree again: $(w1)"
fi
