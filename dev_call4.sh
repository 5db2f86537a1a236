#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "--- decode sweep, 16 q / 4 kv heads (8B at TP=2)"
timeout 200 python3 benchmarks/attention_kernels.py --sweep-decode --cases 16,256,300,2000,4 16,192,500,2000,4 16,128,700,2000,4 16,64,800,2000,4 2>&1 | grep -v Warn | tail -40
