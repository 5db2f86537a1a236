"""Fairness over HTTP. The front-end is one ZMQ client for every HTTP user, so it labels each request's Generates
with the HTTP peer's address and the coordinator's per-client pending limit (--max-pending-per-client) holds per
address: a peer that fills its share gets 429, another peer is still served. And a fan-out request (prompts x n)
that the coordinator refuses in part answers 429 with its accepted parts aborted, so they hold no place."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import httpx
import pytest

from client import Client
from tests.support.openai_http import HttpServer
from tests.support.processes import ROOT

KEY = "fair-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
WAIT_S = 60  # generous: the box may be busy
PER_CLIENT = 4
LONG = {"prompt": "long", "max_tokens": 480, "ignore_eos": True, "stream": True}


def _launch_help() -> str:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "--help"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    flags = ["--api-key", KEY, "--max-pending-requests", "12"]
    if "--max-pending-per-client" in _launch_help():
        flags += ["--max-pending-per-client", str(PER_CLIENT)]
    with HttpServer(tiny_tied, tmp_path_factory.mktemp("fair") / "server.log", *flags) as srv:
        srv.per_client = "--max-pending-per-client" in flags
        yield srv


def _pending_back_to_zero(server) -> dict:
    with Client(server.zmq, timeout=WAIT_S, token=KEY) as c:
        deadline = time.monotonic() + WAIT_S
        while (s := c.stats())["pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
    return s


def _http(local_address: str) -> httpx.Client:
    """A client whose connections come from ``local_address`` (any 127.x.y.z reaches the loopback server)."""
    transport = httpx.HTTPTransport(local_address=local_address)
    return httpx.Client(transport=transport, headers=HEADERS, timeout=WAIT_S)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_fan_out_refused_in_part_is_429_and_its_accepted_parts_are_aborted(server, stream):
    # 2 prompts x n=8: over --max-pending-requests (12), and over the per-client limit where there is one
    body = {"prompt": ["a", "b"], "n": 8, "max_tokens": 300, "ignore_eos": True, "stream": stream}
    with httpx.Client(headers=HEADERS, timeout=WAIT_S) as client:
        r = client.post(server.base_url + "/completions", json=body)
        assert r.status_code == 429, r.text[:300]
        assert r.json()["error"]["type"] == "RateLimitError"
        stats = _pending_back_to_zero(server)  # the accepted ones were aborted: no place is held
        assert stats["pending"] == 0, stats
        r = client.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_one_peer_filling_its_share_leaves_another_served(server):
    if not server.per_client:
        pytest.skip("this launch.py has no --max-pending-per-client")
    with contextlib.ExitStack() as held, _http("127.0.0.1") as greedy, _http("127.0.0.2") as other:
        for _ in range(PER_CLIENT):  # the greedy peer's whole share, running
            resp = held.enter_context(greedy.stream("POST", server.base_url + "/completions", json=LONG))
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            held.callback(lines.close)
        r = greedy.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError", r.text
        r = other.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text  # another address: its own share
    assert _pending_back_to_zero(server)["pending"] == 0  # the greedy streams left: aborted
