#!/usr/bin/env bash
# One device call (one H100): train the default model, then its held-out perplexity through nanoserve (bf16, FP8
# weights, FP8 KV) and HF transformers, and sample completions. The checkpoint lands in $OUT/default_model, the
# log in $OUT/run.log (at most 8 files come back: the 6 of the checkpoint and this log).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NANOSERVE_LT_TUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/run.log"
# STDLIB_TAR: a carried copy of a whole standard library (its *.py files and a VERSION file, in one top folder):
# the device's distribution Python ships its standard library without the test suite
STDLIB=()
if [ -n "$STDLIB_TAR" ]; then
    mkdir -p /tmp/stdlib && tar -xJf "$STDLIB_TAR" -C /tmp/stdlib || exit 1
    STDLIB=(--stdlib "$(ls -d /tmp/stdlib/*)")
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOG"
python3 -m training.train_default_model "$OUT/default_model" --max-seconds "${MAX_SECONDS:-270}" "${STDLIB[@]}" "$@" 2>&1 \
    | grep -v "Writing model shards" | tee -a "$LOG" || exit 1
python3 -m training.evaluate_default_model "$OUT/default_model" "${STDLIB[@]}" 2>&1 | grep -v "^$" | tee -a "$LOG"
