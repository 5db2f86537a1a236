#!/usr/bin/env bash
# One device call: offline W1 and W2, then the same shape behind `launch.py --http-port` measured by benchmarks/serve.py
# at rate=inf, 8 and 32 req/s (W1 requests) and 1 req/s (128 in / 16 out, greedy). SHAPE, EXTRA (engine flags), PORT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SHAPE=${SHAPE:-qwen3-8b}; PORT=${PORT:-8000}; SCALE=${SCALE:-1}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
DIR=$(python3 -c "from benchmarks.shapes import write_shape; print(write_shape('$SHAPE'))")
timeout 150 python3 -m benchmarks.throughput --workload W1 --shape $SHAPE $EXTRA > $OUT/offline_w1.log 2>&1; echo "offline W1 rc=$?"; tail -1 $OUT/offline_w1.log | cut -c1-200
timeout 100 python3 -m benchmarks.throughput --workload W2 --shape $SHAPE $EXTRA > $OUT/offline_w2.log 2>&1; echo "offline W2 rc=$?"; tail -1 $OUT/offline_w2.log | cut -c1-260
python3 launch.py --model $DIR --load-format dummy --max-model-len 4096 --http-port $PORT $EXTRA > $OUT/server.log 2>&1 &
SERVER=$!
python3 - $PORT <<'PY' || { tail -20 $OUT/server.log; kill $SERVER; exit 1; }
import sys, time, httpx
deadline = time.time() + 240
while time.time() < deadline:
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit(1)
PY
S="python3 -m benchmarks.serve --base-url http://127.0.0.1:$PORT/v1 --model $DIR --scale $SCALE"
for spec in "inf --dataset w1" "8 --dataset w1 --num-prompts 128" "32 --dataset w1 --num-prompts 128" \
            "1 --dataset random --random-input-len 128 --random-output-len 16 --num-prompts 20 --temperature 0"; do
  set -- $spec; rate=$1; shift
  log=$OUT/serve_$rate.log
  timeout 150 $S --request-rate $rate "$@" > $log 2>&1; echo "rate=$rate rc=$?"; tail -1 $log
done
kill $SERVER; wait $SERVER 2>/dev/null
