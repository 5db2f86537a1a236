#!/usr/bin/env bash
# W3 with prefix caching on two trees in one device call, every step traced (NANOSERVE_STEP_TRACE): which steps, and
# device busy time, device idle gaps or host launch time, hold the difference? About 100 s on an H100: two engine
# starts of the 0.6B shape (NANOSERVE_LT_TUNE=0) and three 1.7 s W3 rounds on each tree, each side capped at 100 s.
#   [BASE=.whl/base14.tar.gz] [NEW=.] [ROUNDS=3] bash benchmarks/w3_bisect.sh
# BASE / NEW: a tree's directory or a tarball of one (git archive REV | gzip > .whl/at_REV.tar.gz); base14 is c6ee00b.
# Logs, runs and traces in $OUT; the last lines: the compare table (benchmarks/w3_trace.py --compare).
# A CPU smoke run of this script: W3_ARGS="--device cpu --shape tiny --scale 16" ROUNDS=1 SITE=<an existing dir>
# (no step traces there).
SITE=${SITE:-/tmp/site}  # the carried wheels, installed once per machine
[ -d "$SITE" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
  .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NANOSERVE_LT_TUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; ROUNDS=${ROUNDS:-3}; HERE=$PWD
T0=$(date +%s); stamp() { echo "--- $1 ($(( $(date +%s) - T0 )) s)"; }
# PYTHONPATH without this checkout: each side imports only its own tree (the worker processes inherit it)
REST=$(echo "${PYTHONPATH:-}" | tr ':' '\n' | grep -vx -e "$HERE" -e '.' -e '' | paste -sd: -)
[ -d "$SITE" ] && REST=$SITE${REST:+:$REST}
tree() {  # $1 directory or tarball, $2 name -> the tree's directory, holding this checkout's w3_trace.py
  if [ -d "$1" ]; then d=$(cd "$1" && pwd); else d=/tmp/w3_$2; rm -rf "$d"; mkdir -p "$d"; tar xzf "$1" -C "$d"; fi
  [ "$d" = "$HERE" ] || cp "$HERE/benchmarks/w3_trace.py" "$d/benchmarks/"
  echo "$d"
}
B=$(tree "${BASE:-.whl/base14.tar.gz}" base) || exit 1
N=$(tree "${NEW:-.}" new) || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader
for side in base new; do
  dir=$([ $side = base ] && echo "$B" || echo "$N")
  rm -f "$OUT/trace_$side.json"
  (cd "$dir" && PYTHONPATH="$dir${REST:+:$REST}" NANOSERVE_STEP_TRACE="$OUT/trace_$side.json" timeout 100 \
    python3 -m benchmarks.w3_trace --out "$OUT/run_$side.json" --rounds "$ROUNDS" ${W3_ARGS:-} > "$OUT/$side.log" 2>&1)
  echo "$side ($dir): rc $?"; grep -E '^round|Error|error' "$OUT/$side.log" | tail -5
  stamp "$side"
done
for side in base new; do
  echo "== $side: worker/step_trace summary (every step of the engine, warm-up included)"
  [ -f "$OUT/trace_$side.json" ] && (cd "$N" && PYTHONPATH="$N${REST:+:$REST}" python3 -m worker.step_trace "$OUT/trace_$side.json" 2>&1 | head -40)
done
echo "== compare (base = $B, new = $N)"
(cd "$N" && PYTHONPATH="$N${REST:+:$REST}" python3 -m benchmarks.w3_trace --compare "$OUT/run_base.json" \
  "$OUT/trace_base.json" "$OUT/run_new.json" "$OUT/trace_new.json")
stamp done
