#!/usr/bin/env bash
# One device call for the service work (#54): the GPU engine tests and the serving lifecycle tests on CUDA workers
# (worker secret handshake, drain, exits, bounded bodies), then W1 Qwen3-0.6B on this tree and on BASE (a
# `git archive` tarball of an earlier commit, carried in .whl/) in the same call. Logs land in $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; BASE=${BASE:-.whl/base.tar.gz}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -p no:xdist -m gpu tests/engine  # one at a time: each engine takes most of the memory 2>&1 | tee "$OUT/gpu_engine.log" | tail -4
python3 -m pytest -q -n 4 tests/serving/test_lifecycle.py tests/serving/test_drain.py tests/serving/test_openai_shutdown_aborts.py \
    tests/serving/test_openai_admission.py tests/protocol/test_worker_handshake.py tests/serving/test_faults.py 2>&1 \
    | tee "$OUT/serving.log" | tail -4
python3 - <<'PY' 2>&1 | tee "$OUT/cuda_launch.log" | grep "^smoke"
# launch.py on CUDA workers with a key: an SDK completion, a 401, a drain exit 0, then a killed worker's exit 1
import os, signal, subprocess, sys, time, httpx
from openai import OpenAI
from client import Client
env = dict(os.environ, NANOSERVE_API_KEY="k")
def start():
    p = subprocess.Popen([sys.executable, "launch.py", "--device", "cuda", "--http-port", "8123", "--port", "8765"], env=env)
    for _ in range(300):
        if p.poll() is not None:
            sys.exit(f"smoke: the server exited with {p.returncode}")
        try:
            if httpx.get("http://127.0.0.1:8123/health", timeout=2).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit("smoke: server did not come up")
p = start()
c = OpenAI(base_url="http://127.0.0.1:8123/v1", api_key="k")
r = c.completions.create(model=c.models.list().data[0].id, prompt="hello", max_tokens=16)
print("smoke completion tokens", r.usage.completion_tokens)
print("smoke no key ->", httpx.post("http://127.0.0.1:8123/v1/completions", json={}).status_code)
p.send_signal(signal.SIGTERM); print("smoke SIGTERM exit", p.wait(120))
p = start()
with Client("tcp://127.0.0.1:8765", token="k") as z:
    pid = z.info()["worker_pids"][0]
    t = time.monotonic(); os.kill(pid, signal.SIGKILL)
    print("smoke worker killed: launcher exit", p.wait(120), "after %.1f s" % (time.monotonic() - t))
PY
w1() { timeout 200 python3 -m benchmarks.throughput --workload W1 --shape qwen3-0.6b 2>&1 | tail -1 | cut -c1-160; }
echo "W1 this tree: $(w1)"
if [ -f "$BASE" ]; then
  mkdir -p /tmp/base && tar xzf "$BASE" -C /tmp/base && (cd /tmp/base && export PYTHONPATH=/tmp/site:/tmp/base && echo "W1 base: $(w1)")
fi
