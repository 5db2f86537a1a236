#!/usr/bin/env bash
# One call on nvidia-h200-x2: TP=2 correctness over NCCL (torchrun group vs TP=1; logits vs HF), then benchmarks.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"; nvidia-smi -L
python3 - <<'PY'
from model.tiny import TinySpec, write_tiny_checkpoint
write_tiny_checkpoint("/tmp/ck_f32", TinySpec(tie_word_embeddings=False, vocab_size=509, num_hidden_layers=3, seed=2))
write_tiny_checkpoint("/tmp/ck_bf16", TinySpec(hidden_size=256, intermediate_size=512, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, num_hidden_layers=4, dtype="bfloat16", std=0.05, tie_word_embeddings=False))
PY
echo "--- torchrun all-reduce: NCCL vs symmetric-memory one-/two-shot (eager and in CUDA graphs)"
timeout 120 torchrun --nproc-per-node 2 -m benchmarks.allreduce 2>&1 | tee "$OUT/allreduce.log" | grep -v '^{'
echo "--- torchrun TP=2 group vs TP=1, float32 greedy tokens (NCCL + symmetric-memory all-reduce)"
timeout 200 python3 -m tests.tensor_parallel.tp_smoke --model /tmp/ck_f32 --device cuda --tp 2 --max-tokens 32 2>&1 | tail -1 | tee "$OUT/tp_smoke.json"
for dt in float32 bfloat16; do
  ck=/tmp/ck_f32; [ $dt = bfloat16 ] && ck=/tmp/ck_bf16
  echo "--- torchrun TP=2 teacher-forced logits vs HF, $dt"
  timeout 120 torchrun --nproc-per-node 2 -m tests.tensor_parallel.tp_logits --model $ck --device cuda --dtype $dt 2>&1 | grep '^{' | tee -a "$OUT/tp_logits.json"
done
LIMIT=${LIMIT:-170} bash benchmarks/gpu_bench.sh "$@" 2>&1 | tail -8
