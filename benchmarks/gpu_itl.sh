#!/usr/bin/env bash
# One device call (~100 s, Qwen3-8B shape): why a step with prefill tokens costs about a decode step more (log 53c:
# ITL p99 / p50 1.99 at 50% load, worse with smaller prefill chunks). `launch.py --http-port` with a step trace on
# rank 0 (NANOSERVE_STEP_TRACE) takes W1 requests at 50% of OFFLINE_TOK_S for SWEEP_S seconds; then the trace's
# summary: device busy and idle (gap), host wait and launch, Triton compiles, for decode-only steps against steps
# with prefill tokens, by batch size, and the longest gaps. Knobs: SHAPE, EXTRA (engine flags), OFFLINE_TOK_S,
# SWEEP_S, PORT, OUT.
if ! python3 -c "import zmq, fastapi, uvicorn" 2>/dev/null; then  # the device image lacks them: carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NANOSERVE_LT_TUNE=0
SHAPE=${SHAPE:-qwen3-8b}; PORT=${PORT:-8000}; OUT=${OUT:-/tmp/out}; SWEEP_S=${SWEEP_S:-10}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && OFFLINE_TOK_S=${OFFLINE_TOK_S:-7766}
OFFLINE_TOK_S=${OFFLINE_TOK_S:-9707}
DIR=$(python3 -c "from benchmarks.shapes import write_shape; print(write_shape('$SHAPE'))") || exit 1
NANOSERVE_STEP_TRACE="$OUT/steps.json" python3 launch.py --model "$DIR" --load-format dummy --max-model-len 4096 \
  --http-port "$PORT" $EXTRA > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
python3 - "$PORT" <<'PY' || { echo "the server did not start"; tail -20 "$OUT/server.log"; exit 1; }
import sys, time, urllib.request
for _ in range(300):
    try:
        sys.exit(0 if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status == 200 else 1)
    except OSError:
        time.sleep(0.5)
sys.exit(1)
PY
timeout 120 python3 -m benchmarks.serve --base-url "http://127.0.0.1:$PORT/v1" --model "$DIR" --sweep --loads 0.5 \
  --offline-tok-s "$OFFLINE_TOK_S" --sweep-seconds "$SWEEP_S" --sweep-min-requests 15 --drain-seconds 30 \
  > "$OUT/sweep.log" 2>&1
grep -v '^{' "$OUT/sweep.log" | tail -4
kill -TERM $SERVER; wait $SERVER 2>/dev/null  # the trace is written at shutdown
python3 -m worker.step_trace "$OUT/steps.json"
