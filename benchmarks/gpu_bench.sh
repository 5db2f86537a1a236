#!/usr/bin/env bash
# One device call: the throughput workloads in sequence, each bounded; JSON lines to $OUT/bench.jsonl, table last.
# usage: bash benchmarks/gpu_bench.sh "W1 --shape qwen3-0.6b" "NANOSERVE_PDL=0 W2 --shape qwen3-8b" ...
# (leading NAME=value words of a spec are set in that run's environment)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-200}
for spec in "$@"; do
  envs=(); set -- $spec
  while [[ $1 == *=* ]]; do envs+=("$1"); shift; done
  workload=$1; shift; rest="$*"
  log="$OUT/$(echo "$spec" | tr -c 'A-Za-z0-9.-' '_').log"
  echo "=== $spec" | tee -a "$OUT/bench.jsonl.log"
  timeout "$LIMIT" env "${envs[@]}" python3 -m benchmarks.throughput --workload $workload $rest >"$log" 2>&1
  echo "rc=$? $spec" >>"$OUT/bench.jsonl.log"
  tail -n 1 "$log" | grep '^{' | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d['spec']=sys.argv[1]; print(json.dumps(d))" "$spec" >>"$OUT/bench.jsonl" || tail -n 5 "$log"
done
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
print(f"{'run':48s} {'tok/s':>9s} {'median':>9s} {'floor%':>7s} {'ms/tok':>7s} {'hf tok/s':>9s} {'s':>7s}")
for line in open(sys.argv[1]):
    d = json.loads(line)
    ms = d.get("ms_per_token")
    hf = d.get("hf_tok_s") or d.get("hf_ms_per_token")
    med = d.get("tok_s_median")  # with --repeat N: the median of the rounds
    print(f"{d['spec'][:48]:48s} {d['tok_s']:9.0f} {med or '-'!s:>9s} {100 * d['floor_fraction']:6.1f}% {ms if ms is None else round(ms, 3)!s:>7s} {hf!s:>9s} {d['seconds']:7.2f}")
PY
