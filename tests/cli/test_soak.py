"""benchmarks/soak.py, the soak and fault script users run, for a short while: it starts a server (launch.py with the
HTTP front-end), drives mixed HTTP and ZMQ traffic with faults and a killed client, stops the server cleanly, and
reports what it saw. A healthy server gives no unexpected outcome, and every KV block is free again at the end."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import ROOT
from tests.support.server import ENGINE_ARGS


def test_a_short_soak_with_faults_reports_and_sees_nothing_unexpected(tiny_tied, tmp_path):
    cmd = [
        sys.executable, "-m", "benchmarks.soak", "--minutes", "0.5", "--faults", "--concurrency", "4",
        "--sample-s", "10", "--log", str(tmp_path / "server.log"), "--", "--model", str(tiny_tied), *ENGINE_ARGS,
    ]  # fmt: skip
    # generous: the server's start and the traffic's end (idle wait included) on a loaded 2-core machine
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    log = (tmp_path / "server.log").read_text()
    assert out.stdout.strip(), f"no output; stderr:\n{out.stderr[-3000:]}\nserver log:\n{log[-3000:]}"
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    context = f"{json.dumps(summary, indent=1)[:6000]}\nserver log:\n{log[-3000:]}"
    assert out.returncode == 0 and summary["unexpected"] == 0, context
    assert summary["requests"] > 0 and summary["latency_p50_ms"] > 0 and summary["latency_p99_ms"] > 0, context
    for key in ("errors", "kv_blocks_total", "start", "end", "samples", "per_action", "server_exit_code"):
        assert key in summary, key
    # every kind of traffic ran: HTTP and ZMQ, faults and the killed client included
    for action in ("http_completion_stream", "http_chat", "zmq_stream", "http_fault", "killed_client"):
        assert action in summary["per_action"], (action, context)
    start, end = summary["start"], summary["end"]
    for side in ("coordinator", "front_end"):
        assert start[f"{side}_rss_mib"] > 0 and end[f"{side}_fds"] > 0, (side, context)
    assert start["kv_blocks_free"] == end["kv_blocks_free"] == summary["kv_blocks_total"], context
    assert end["pending"] == 0, context
    assert summary["server_exit_code"] == 0, context
