#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "--- GPU tests: symmetric all-reduce, fused norm, overlapped prefill"
timeout 360 python3 -m pytest -q -x tests/test_symm_allreduce.py 2>&1 | tail -4
echo "--- W1"
LIMIT=130 bash benchmarks/gpu_bench.sh "W1 --shape qwen3-8b --tp 2" "NANOSERVE_NO_COMM_OVERLAP=1 W1 --shape qwen3-8b --tp 2" "NANOSERVE_OVERLAP_PROGRAMS=64 W1 --shape qwen3-8b --tp 2" "CUDA_VISIBLE_DEVICES=0 W1 --shape qwen3-8b" 2>&1 | tail -5
grep -h "overlapped" $OUT/*.log | sort | uniq -c
