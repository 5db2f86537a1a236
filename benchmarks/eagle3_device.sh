#!/usr/bin/env bash
# EAGLE-3 on the device, one call (~170 s on an H100/H200): the GPU tests (eager and CUDA graphs: exact, accepted,
# drafts equal the reference's; the draft's own graphs replay and draft as the eager drafter), then W2 on the Qwen3-8B shape with a random-weight draft in the public layout
# (benchmarks/eagle3_draft.py): off / eagle3 k=3 (acceptance ~0: what drafting costs when it fails) / eagle3 k=3 with
# every draft kept (NANOSERVE_BENCH_ACCEPT_DRAFTS=1, benchmark only: the ceiling, drafting included). Logs in $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -p no:randomly tests/engine/test_speculative_gpu.py -k eagle3 2>&1 | tee "$OUT/eagle3_gpu_tests.log" | tail -15
DRAFT=$(python3 -m benchmarks.eagle3_draft qwen3-8b) || exit 1
SPEC="{\"method\": \"eagle3\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": 3}"
run() {  # label, extra args...
    local label=$1; shift
    python3 -m benchmarks.throughput --workload W2 --shape qwen3-8b "$@" >"$OUT/w2_$label.log" 2>&1
    echo "$label $(grep -h 'ms/token after' "$OUT/w2_$label.log" | sed 's/^W2 *//')"
}
echo "== W2 qwen3-8b shape, bf16, batch 1 =="
run off
run eagle3_k3_random --speculative-config "$SPEC"
NANOSERVE_BENCH_ACCEPT_DRAFTS=1 run eagle3_k3_ceiling --speculative-config "$SPEC"
grep -ho '"spec_decode[a-z_]*": [0-9\[\], ]*' "$OUT"/w2_eagle3_*.log | tr '\n' ' '; echo
echo "draft graph capture (s, per W2 start): $(grep -ho 'draft graphs [0-9.]*' "$OUT"/w2_eagle3_*.log | tr '\n' ' ')"
