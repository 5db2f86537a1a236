"""The latency tools end to end on the CPU (small numbers; no timing is asserted): benchmarks/serve.py --sweep
against a real ``launch.py --http-port`` server reports every load with its latencies and goodput, and
benchmarks/plot_latency.py draws the JSON; benchmarks/ttft_trail.py's time stamps still fit the coordinator's and
the front-end's code (every hop of a streamed request is found)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.openai_http import HttpServer
from tests.support.processes import ROOT
from tests.support.timeouts import START_S


@pytest.fixture(scope="module")
def http_server(tiny_tied, tmp_path_factory):
    with HttpServer(tiny_tied, tmp_path_factory.mktemp("sweep") / "server.log") as srv:
        yield srv


def test_sweep_reports_each_load_and_plots(http_server, tmp_path):
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "benchmarks.serve", "--base-url", http_server.base_url, "--sweep", "--scale", "32",
           "--loads", "0.5", "1", "--offline-tok-s", "100", "--sweep-seconds", "1", "--sweep-min-requests", "3",
           "--sweep-max-requests", "4", "--max-token-id", "200", "--label", "CPU test", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert done.returncode == 0, done.stderr[-2000:]
    sweep = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == sweep
    assert [s["load"] for s in sweep["loads"]] == [0.5, 1.0]
    assert sweep["capacity"]["tok_s"] == 100 and sweep["capacity"]["req_s"] > 0
    assert sweep["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 100.0, "as": "vllm bench serve --goodput"}
    for s in sweep["loads"]:
        assert s["num_requests"] in (3, 4) and s["completed"] == s["num_requests"], s["first_error"]
        assert s["rate_req_s"] == pytest.approx(s["load"] * sweep["capacity"]["req_s"])
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and 0 < s["itl_ms"]["p50"] <= s["itl_ms"]["p99"]
        assert 0 <= s["goodput_tok_s"] <= s["output_tok_s"] and s["good_requests"] <= s["completed"]
        assert s["steady_output_tok_s"] >= 0
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    plot = [sys.executable, "-m", "benchmarks.plot_latency", str(out), "-o", str(png)]
    drawn = subprocess.run(plot, cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_steady_rate_counts_the_chunks_inside_the_window():
    from benchmarks.serve_requests import Result
    from benchmarks.serve_sweep import steady_tok_s

    a = Result(ok=True, sent=10.0, ttft=1.0, itl=[1.0, 1.0, 1.0])  # chunks at 11, 12, 13, 14
    b = Result(ok=True, sent=12.5, ttft=0.25, itl=[2.0])  # 12.75, 14.75
    failed = Result(ok=False, sent=10.0, ttft=1.0, itl=[0.5])
    assert steady_tok_s([a, b, failed], 11.5, 13.5) == pytest.approx(3 / 2.0)  # 12, 12.75, 13


def test_ttft_trail_finds_every_hop(tiny_tied):
    cmd = [sys.executable, "-m", "benchmarks.ttft_trail", "--model", str(tiny_tied), "--paths", "zmq", "http",
           "--requests", "3", "--rounds", "1", "--warmup", "1", "--gap", "0", "--max-id", "500", "--",
           "--device", "cpu", "--max-model-len", "512", "--num-kv-blocks", "128"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    zmq_hops = ["c_send", "k_recv", "k_decoded", "k_tokenized", "k_admitted", "k_step", "k_sent", "k_result",
                "k_reply", "c_first"]  # fmt: skip
    http_hops = ["c_send", "f_bytes", "f_app", "f_route", "f_sent", *zmq_hops[1:-1], "f_delta", "f_started", "f_resp",
                 "f_hdr", "f_sse", "c_first"]  # fmt: skip
    for path, stamps in (("zmq", zmq_hops), ("http", http_hops)):
        assert list(res[path]["hops_p50_ms"]) == [f"{a}->{b}" for a, b in zip(stamps, stamps[1:])], path
        assert res[path]["p50_ms"] > 0
