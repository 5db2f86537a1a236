#!/usr/bin/env bash
# One device call (<= ~200 s on an H200, Qwen3-8B shape): offline W2 (its TTFT: the in-process probe), then
# `launch.py --http-port` measured by benchmarks/serve.py: TTFT at 1 req/s (128 ids in, 16 out, greedy; target:
# p50 within 1.5 ms of offline W2's TTFT) and the latency-under-load sweep (W1 requests at 25/50/75/100% of
# OFFLINE_TOK_S, offline W1's output tok/s: docs/PERFORMANCE.md's row unless given). Writes $OUT/latency_sweep.json
# (and .png when matplotlib is there; else plot it here: python -m benchmarks.plot_latency latency_sweep.json).
# Knobs: SHAPE, EXTRA (engine flags), PORT, OFFLINE_TOK_S, RATE1_N (requests at 1 req/s), SWEEP_S (arrival seconds
# a load), SWEEP_MAX (requests a load), SCALE (W1 lengths divided by it), LABEL.
if ! python3 -c "import zmq, fastapi, uvicorn" 2>/dev/null; then  # the device image lacks them: carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SHAPE=${SHAPE:-qwen3-8b}; PORT=${PORT:-8000}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# offline W1 Qwen3-8B: 9,707 tok/s on an H200 (docs/PERFORMANCE.md); an H100's is not measured: 80% of it assumed
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && OFFLINE_TOK_S=${OFFLINE_TOK_S:-7766}
OFFLINE_TOK_S=${OFFLINE_TOK_S:-9707}; RATE1_N=${RATE1_N:-25}; SWEEP_S=${SWEEP_S:-15}; SWEEP_MAX=${SWEEP_MAX:-300}
SCALE=${SCALE:-1}; LABEL=${LABEL:-"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $SHAPE"}
T0=$(date +%s)
DIR=$(python3 -c "from benchmarks.shapes import write_shape; print(write_shape('$SHAPE'))") || exit 1

timeout 100 python3 -m benchmarks.throughput --workload W2 --shape "$SHAPE" $EXTRA > "$OUT/offline_w2.log" 2>&1
echo "offline W2 rc=$? ($(( $(date +%s) - T0 )) s)"

python3 launch.py --model "$DIR" --load-format dummy --max-model-len 4096 --http-port "$PORT" $EXTRA \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
python3 - "$PORT" <<'PY' || { echo "the server did not start"; tail -20 "$OUT/server.log"; exit 1; }
import sys, time, urllib.request
deadline = time.time() + 150
while time.time() < deadline:
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
echo "server ready ($(( $(date +%s) - T0 )) s)"
S="python3 -m benchmarks.serve --base-url http://127.0.0.1:$PORT/v1 --model $DIR"
timeout 60 $S --dataset random --random-input-len 128 --random-output-len 16 --num-prompts "$RATE1_N" \
  --request-rate 1 --temperature 0 > "$OUT/serve_rate1.log" 2>&1
echo "1 req/s rc=$? ($(( $(date +%s) - T0 )) s)"
timeout 150 $S --sweep --offline-tok-s "$OFFLINE_TOK_S" --scale "$SCALE" --sweep-seconds "$SWEEP_S" \
  --sweep-min-requests 15 --sweep-max-requests "$SWEEP_MAX" --drain-seconds 30 --label "$LABEL" \
  --out "$OUT/latency_sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$? ($(( $(date +%s) - T0 )) s)"
python3 -c "import matplotlib" 2>/dev/null && python3 -m benchmarks.plot_latency "$OUT/latency_sweep.json" >/dev/null

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def last_json(name):
    try:
        return json.loads(open(f"{out}/{name}").read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
w2, r1, sw = last_json("offline_w2.log"), last_json("serve_rate1.log"), last_json("sweep.log")
print("| measure | value |\n|---|---|")
if w2:
    print(f"| offline W2 TTFT (median of 3) | {w2['ttft_ms']:.2f} ms ({w2['ms_per_token']:.3f} ms/token) |")
if r1:
    t = r1["ttft_ms"]
    print(f"| HTTP TTFT at 1 req/s, 128 in / 16 out ({r1['completed']} ok) | p50 {t['p50']:.2f} ms, mean {t['mean']:.2f}, "
          f"p99 {t['p99']:.2f}; server's own mean {r1['server_ttft_mean_ms'] or 0:.2f}; ITL p50 {r1['itl_ms']['p50']:.2f} |")
if w2 and r1:
    print(f"| HTTP p50 - offline TTFT (target <= 1.5 ms) | {r1['ttft_ms']['p50'] - w2['ttft_ms']:+.2f} ms |")
if sw:
    c = sw["capacity"]
    print(f"| sweep capacity | {c['tok_s']:,.0f} output tok/s = {c['req_s']:.2f} req/s ({c['source']}) |")
    for s in sw["loads"]:
        t, i = s["ttft_ms"], s["itl_ms"]
        print(f"| load {100 * s['load']:.0f}% ({s['rate_req_s']:.2f} req/s, {s['completed']}/{s['num_requests']} ok) | "
              f"TTFT p50 {t['p50']:.1f} p99 {t['p99']:.1f} ms; ITL p50 {i['p50']:.2f} p99 {i['p99']:.2f} ms "
              f"(p99/p50 {s['itl_p99_over_p50'] or 0:.2f}); out {s['output_tok_s']:,.0f} tok/s, while arriving "
              f"{s.get('steady_output_tok_s') or 0:,.0f}, goodput "
              f"{s['goodput_tok_s']:,.0f} tok/s |")
PY
