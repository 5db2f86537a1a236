#!/usr/bin/env bash
# One device call (~100-200 s): the loader's GPU tests, then how fast a Qwen3-8B-shaped checkpoint (16.4 GB bf16
# in 5 files, written once to the local disk, the write timed) loads against `dd bs=16M` on the same files, page
# cache evicted before each: ours (auto: pinned buffers + async copies), safetensors' own reader (the old path),
# ours asking the kernel to read 64 MB ahead, and TP=2 ranks each reading its own shard. Measures the disk on
# Qwen3-0.6B first and falls back to it (saying so) when the 8B shape would not fit the time. Logs in $OUT.
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then  # the tests import nanoserve (pyzmq): the lead's carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NANOSERVE_CACHE=${NANOSERVE_CACHE:-$HOME/.cache/nanoserve}; mkdir -p "$NANOSERVE_CACHE"
T0=$(date +%s)
stamp() { echo "--- $1 ($(( $(date +%s) - T0 )) s)"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
df -hT "$NANOSERVE_CACHE" | tail -1
free -g | sed -n 2p
stamp "GPU tests of the loader"
timeout 90 python3 -m pytest -q -p no:randomly tests/model/test_weight_stream.py -m gpu 2>&1 \
  | tee "$OUT/load_tests.log" | tail -4
stamp "load_weights"
timeout 170 python3 -m benchmarks.load_weights --shape qwen3-8b --device cuda --probe-shape qwen3-0.6b --budget-s 130 \
  --runs auto,safetensors,auto:ahead=64 --tp 2 --tp-runs auto --check 2>&1 \
  | tee "$OUT/load_weights.log" | grep -v Warning | tail -22
stamp "done"
