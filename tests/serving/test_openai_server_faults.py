"""The HTTP server's refusals and faults: a non-loopback host without a key, an HTTP port in use, 401 without the
key, 429 past --max-pending-requests, 503 once the engine is dead, and the front-end exiting with its parent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from client import Client
from protocol.codec import ProtocolError
from tests.support.openai_http import HttpServer
from tests.support.processes import ROOT, children_of, pid_alive

KEY = "s3cret-key"
LAUNCH = [sys.executable, str(ROOT / "launch.py")]


def test_non_loopback_host_needs_a_key():
    out = subprocess.run(
        [*LAUNCH, "--host", "0.0.0.0", "--port", "0", "--http-port", "0"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert "--api-key" in out.stderr


def test_http_port_in_use_fails_before_loading():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run(
            [*LAUNCH, "--port", "0", "--http-port", str(port), "--model", "/nonexistent"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 1
    assert f"HTTP port {port} on 127.0.0.1 is already in use" in out.stderr


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    flags = ["--api-key", KEY, "--max-pending-requests", "2"]
    with HttpServer(tiny_tied, tmp_path_factory.mktemp("http_keyed") / "server.log", *flags) as srv:
        yield srv


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    r = httpx.post(server.base_url + "/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.post(server.root + "/tokenize", json={"prompt": "x"}).status_code == 401
    api = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    r = api.completions.create(model=api.models.list().data[0].id, prompt="hi", max_tokens=3)
    assert r.usage.completion_tokens <= 3
    assert httpx.get(server.root + "/health").status_code == 200  # probes need no key
    assert httpx.get(server.root + "/metrics").status_code == 200
    with Client(server.zmq, timeout=30) as c, pytest.raises(ProtocolError, match="unauthorized"):
        c.health()  # the coordinator's ZMQ endpoint takes the same key as its token


def test_overloaded_is_429_and_the_server_keeps_serving(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30, headers=headers) as client:
        streams = [client.stream("POST", server.base_url + "/completions", json=body) for _ in range(2)]
        lines = []  # kept: dropping a line iterator closes its response
        try:
            for s in streams:  # both are pending in the coordinator once their first event arrived
                resp = s.__enter__()
                assert resp.status_code == 200
                lines.append(resp.iter_lines())
                next(lines[-1])
            r = client.post(server.base_url + "/completions", json={**body, "stream": False, "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "RateLimitError"
        finally:
            for s in streams:
                s.__exit__(None, None, None)  # disconnect: both are aborted
        deadline = time.monotonic() + 20
        while True:  # the aborts free both places
            r = client.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def test_dead_engine_is_503_and_the_front_end_exits_with_its_parent(server):
    with Client(server.zmq, timeout=30, token=KEY) as c:
        (worker,) = c.info()["worker_pids"]
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(server.root + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = httpx.get(server.root + "/health")
    assert r.status_code == 503 and "dead" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert httpx.get(server.root + "/metrics").status_code == 200

    front_ends = [
        p for p in children_of(server.proc.pid) if b"openai_server" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert len(front_ends) == 1
    server.proc.kill()  # no cleanup at all: the front-end must notice by itself
    server.proc.wait()
    deadline = time.monotonic() + 15
    while pid_alive(front_ends[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(front_ends[0])
