#!/usr/bin/env bash
# One device call (<= 150 s): start-up of `launch.py` on the Qwen3-8B shape (dummy weights, TP=1), twice with the same
# fresh cache dirs (NANOSERVE_CACHE, TRITON_CACHE_DIR): a cold start (nothing cached: Triton compiles, cuBLASLt is
# tuned) then a warm one (both read back). Prints benchmarks/startup.py's table: wall time to ready and to the first
# token, and each process's phases. SHAPE (default qwen3-8b), RUNS (default 2), EXTRA (more engine flags), OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SHAPE=${SHAPE:-qwen3-8b}; RUNS=${RUNS:-2}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 135 python3 -m benchmarks.startup --shape "$SHAPE" --runs "$RUNS" --timeout 95 --log-dir "$OUT/startup" \
  -- --max-model-len 4096 $EXTRA > "$OUT/startup.txt" 2>&1
rc=$?
echo "benchmarks.startup rc=$rc (logs: $OUT/startup/run*.log)"
[ $rc -eq 0 ] || { tail -5 "$OUT/startup.txt"; for f in "$OUT"/startup/run*.log; do echo "== $f"; tail -25 "$f"; done; }
grep -v '^{' "$OUT/startup.txt" | tail -50
