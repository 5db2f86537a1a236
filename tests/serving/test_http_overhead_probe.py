"""benchmarks/http_overhead.py runs end to end: its stand-in engine still fits the coordinator Server's engine
interface, and the real front-end streams every request's events through it (no timing is asserted)."""

import json
import subprocess
import sys

from tests.support.processes import ROOT
from tests.support.timeouts import START_S


def test_probe_streams_through_the_real_server_and_front_end():
    cmd = [sys.executable, "-m", "benchmarks.http_overhead", "--requests", "25", "--rounds", "1"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(res) == {"http_p50_ms", "zmq_p50_ms", "http_mean_ms", "zmq_mean_ms", "front_end_p50_ms"}
    assert all(res[k] > 0 for k in ("http_p50_ms", "zmq_p50_ms", "http_mean_ms", "zmq_mean_ms"))
