"""The HTTP server's refusals and faults: a non-loopback host without a key, an HTTP port in use, 401 without the
key, 429 past --max-pending-requests, 400 for a request over the coordinator's --max-message-bytes (other streams go
on) and 413 for a body over it, unread, 400s in OpenAI's shape for bodies that are not valid JSON, not
Unicode or nested too deep, SIGINT and SIGTERM to the front-end (on its own: SIGINT ends it, exit 0; under a parent it
leaves both to the parent, which stops it with SIGUSR1), 503 once the engine is dead, and the front-end ending its
streams and exiting with its parent."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from client import Client
from openai_server import STOP_SIGNAL
from protocol.codec import ProtocolError
from tests.support.openai_http import HttpServer
from tests.support.processes import ROOT, children_of, pid_alive, sigint_default
from tests.support.timeouts import HANG_S, START_S

KEY = "s3cret-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
MESSAGE_LIMIT = 256 << 10  # the server's --max-message-bytes
LAUNCH = [sys.executable, str(ROOT / "launch.py")]


def test_non_loopback_host_needs_a_key():
    out = subprocess.run(
        [*LAUNCH, "--host", "0.0.0.0", "--port", "0", "--http-port", "0"],
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert out.returncode == 1
    assert "--api-key" in out.stderr


def test_http_port_in_use_fails_before_loading(tiny_tied):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run(
            [*LAUNCH, "--port", "0", "--http-port", str(port), "--model", str(tiny_tied)],
            capture_output=True, text=True, timeout=START_S,
        )  # fmt: skip
    assert out.returncode == 1
    assert f"HTTP port {port} on 127.0.0.1 is already in use" in out.stderr


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    flags = ["--api-key", KEY, "--max-pending-requests", "2", "--max-message-bytes", str(MESSAGE_LIMIT)]
    with HttpServer(tiny_tied, tmp_path_factory.mktemp("http_keyed") / "server.log", *flags) as srv:
        yield srv


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    r = httpx.post(server.base_url + "/completions", json={"prompt": "x"}, timeout=HANG_S)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.post(server.root + "/tokenize", json={"prompt": "x"}, timeout=HANG_S).status_code == 401
    api = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    r = api.completions.create(model=api.models.list().data[0].id, prompt="hi", max_tokens=3)
    assert r.usage.completion_tokens <= 3
    assert httpx.get(server.root + "/health", timeout=HANG_S).status_code == 200  # probes need no key
    assert httpx.get(server.root + "/metrics", timeout=HANG_S).status_code == 200
    with Client(server.zmq, timeout=HANG_S) as c, pytest.raises(ProtocolError, match="unauthorized"):
        c.health()  # the coordinator's ZMQ endpoint takes the same key as its token


def test_overloaded_is_429_and_the_server_keeps_serving(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=HANG_S, headers=headers) as client:
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
        deadline = time.monotonic() + HANG_S
        while True:  # the aborts free both places
            r = client.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def _error(resp: httpx.Response, status: int, param) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["code"] == status
    return err["message"]


def test_request_over_the_message_limit_is_400_and_other_streams_go_on(server):
    """The front-end learns the coordinator's --max-message-bytes: a larger body is a 413, unread; a body within it
    whose request still comes out larger (its fields around the text) is refused by the front-end itself: sent, it
    would be dropped by ZMQ with the front-end's shared connection, hanging it and every stream on it."""
    # the chat body is exactly at the limit (so it is read), the message (its id, client label, fields) is not
    shell = len(json.dumps({"messages": [{"role": "user", "content": ""}], "max_tokens": 2, "stream": False}))
    big = "a" * (MESSAGE_LIMIT - shell)
    long = {"prompt": "long", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=HANG_S, headers=HEADERS) as client:
        with client.stream("POST", server.base_url + "/completions", json=long) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")  # in flight
            chat = {"messages": [{"role": "user", "content": big}], "max_tokens": 2}
            for stream in (False, True):
                r = client.post(server.base_url + "/chat/completions", json={**chat, "stream": stream})
                assert f"limit of {MESSAGE_LIMIT} bytes" in _error(r, 400, "messages")
            wide = "a" * (MESSAGE_LIMIT - len(json.dumps({"prompt": ["x", ""], "max_tokens": 2})))
            r = client.post(server.base_url + "/completions", json={"prompt": ["x", wide], "max_tokens": 2})
            assert "--max-message-bytes" in _error(r, 400, "prompt")
            cap = MESSAGE_LIMIT
            body = b'{"prompt": "' + b"a" * cap + b'"}'
            assert str(cap) in _error(client.post(server.base_url + "/completions", content=body), 413, None)
            chunked = iter([body[: cap // 2], body[cap // 2 :]])  # no Content-Length: counted as it arrives
            assert str(cap) in _error(client.post(server.base_url + "/completions", content=chunked), 413, None)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
        r = client.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_bad_bodies_are_400s_in_openai_shape(server):
    """Text that is not Unicode (a lone surrogate), JSON too deep to parse, prompts longer than the context:
    400s naming the field, never a 500 or FastAPI's {"detail": ...}."""
    chat, completions = server.base_url + "/chat/completions", server.base_url + "/completions"
    with httpx.Client(timeout=HANG_S, headers={**HEADERS, "content-type": "application/json"}) as client:
        bodies = [
            (chat, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages"),
            (chat, b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "stream": true}', "messages"),
            (completions, b'{"prompt": "a\\udfffb", "max_tokens": 2}', "prompt"),
            (completions, b'{"prompt": "ab", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
            (server.root + "/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ]
        for url, body, param in bodies:
            assert "Unicode" in _error(client.post(url, content=body), 400, param)
        ok = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'  # a valid pair
        assert client.post(chat, content=ok).status_code == 200
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert "could not be parsed" in _error(client.post(completions, content=deep), 400, None)
        assert "not valid JSON" in _error(client.post(completions, content=b'{"prompt": '), 400, None)
        _error(client.get(server.base_url + "/nothing"), 404, None)
        long = "hello " * 600  # over max_model_len (512) in tokens
        _error(
            client.post(chat, json={"messages": [{"role": "user", "content": long}], "max_tokens": 2}), 400, "messages"
        )
        too_many_chars = {"messages": [{"role": "user", "content": long * 20}], "max_tokens": 2}
        _error(client.post(chat, json=too_many_chars), 400, "messages")
        _error(client.post(completions, json={"prompt": long, "max_tokens": 2}), 400, "prompt")
        _error(client.post(completions, json={"prompt": "x", "max_tokens": 900}), 400, "max_tokens")  # what to lower
        assert client.post(completions, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def _process_state(pid: int | str = "self") -> str:
    """Its signal state as the kernel sees it and where each thread waits, for a hang's report."""
    proc = Path(f"/proc/{pid}")
    sig = [line for line in (proc / "status").read_text().splitlines() if line.startswith(("Sig", "ShdPnd"))]
    waits = [f"{(t / 'comm').read_text().strip()} {(t / 'stat').read_text().split(') ')[1][0]} syscall "
             f"{(t / 'syscall').read_text().split(' ')[0]}" for t in sorted((proc / "task").iterdir())]  # fmt: skip
    return f"{sig} threads {waits}"


@pytest.mark.parametrize("child", [False, True], ids=["standalone", "child"])
def test_signals_to_the_front_end(server, tmp_path, child):
    # standalone: Ctrl-C stops it cleanly; as launch.py's child (--parent-pid) it ignores SIGINT and SIGTERM, which
    # reach the whole process group, and the parent stops it with STOP_SIGNAL
    cmd = [sys.executable, "-m", "openai_server", "--address", server.zmq, "--port", "0"]
    cmd += ["--parent-pid", str(os.getpid())] if child else []
    env = dict(os.environ, NANOSERVE_API_KEY=KEY, PYTHONUNBUFFERED="1")
    log = tmp_path / "front_end.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
            preexec_fn=sigint_default,  # Ctrl-C as at a terminal, though we may run under nohup with SIGINT ignored
        )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("nanoserve OpenAI API on "), line
        root = line.split()[4].removesuffix("/v1")
        assert httpx.get(root + "/health", timeout=HANG_S).status_code == 200  # serving: its loop runs
        proc.send_signal(signal.SIGINT)
        if child:
            proc.send_signal(signal.SIGTERM)
            time.sleep(1)  # an idle front-end that took a signal is gone by now
            assert proc.poll() is None and httpx.get(root + "/health", timeout=HANG_S).status_code == 200
            proc.send_signal(STOP_SIGNAL)  # as launch.py stops it
            assert proc.wait(HANG_S) == 0
        else:
            try:
                assert proc.wait(HANG_S) == 0
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"no exit on SIGINT: {_process_state(proc.pid)}; ours {_process_state()}"
                ) from None
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_streams_end_with_an_error_when_the_front_ends_parent_dies(server, tmp_path):
    # the front-end under a parent that is SIGKILLed (as launch.py may be): its streams end at once with an error
    # event, not cut after the graceful shutdown's wait
    front_end = [sys.executable, "-m", "openai_server", "--address", server.zmq, "--port", "0"]
    parent = f"import os, subprocess, sys; subprocess.run({front_end!r} + ['--parent-pid', str(os.getpid())])"
    env = dict(os.environ, NANOSERVE_API_KEY=KEY, PYTHONUNBUFFERED="1")
    with open(tmp_path / "front_end.log", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
    events: list[str] = []
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("nanoserve OpenAI API on "), line
        url = line.split()[4] + "/completions"
        body = {"prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True}

        def read() -> None:
            with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=HANG_S) as r:
                events.extend(x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: "))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + HANG_S
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()
        reader.join(30)
        assert events[-1] == "[DONE]" and "is gone" in events[-2], events[-3:]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_dead_engine_is_503_and_the_service_exits_1(server):
    # the module's last test: it ends the server. A worker's death fails the request in flight (503) and the
    # launcher exits 1, stopping its front-end: a supervisor restarts the service (tests/serving/test_lifecycle.py)
    front_ends = [
        p for p in children_of(server.proc.pid) if b"openai_server" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert len(front_ends) == 1
    with Client(server.zmq, timeout=HANG_S, token=KEY) as c:
        (worker,) = c.info()["worker_pids"]
        out: list = []
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True}
        url = server.base_url + "/completions"
        t = threading.Thread(target=lambda: out.append(httpx.post(url, json=body, headers=HEADERS, timeout=HANG_S)))
        t.start()
        deadline = time.monotonic() + HANG_S
        while c.stats()["pending"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    os.kill(worker, signal.SIGKILL)
    t.join(60)
    (r,) = out
    assert r.status_code == 503 and "dead" in r.json()["error"]["message"], r.text
    assert server.proc.wait(HANG_S) == 1, server.stderr()
    deadline = time.monotonic() + HANG_S
    while pid_alive(front_ends[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(front_ends[0])
