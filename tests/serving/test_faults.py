"""Faults, with real processes: a worker killed mid-stream, the coordinator killed, SIGTERM/SIGINT (to launch.py
alone, and to its whole process group with the HTTP front-end), a port in use, a missing token."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from client import AbortedError, Client, EngineDeadError, SamplingParams
from protocol.codec import ProtocolError
from tests.support.openai_http import HttpServer
from tests.support.processes import ROOT, children_of, pid_alive, wait_gone
from tests.support.server import ServerProcess, generate_in_thread
from tests.support.timeouts import HANG_S, START_S

LONG_CONTEXT = ["--max-model-len", "2048", "--num-kv-blocks", "1024"]
LONG = SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True)  # seconds of work: still running when hit


def _ipc_dir(worker_pid: int) -> Path | None:
    """The private directory of the coordinator's worker socket, from the worker's command line."""
    args = Path(f"/proc/{worker_pid}/cmdline").read_bytes().split(b"\0")
    address = args[args.index(b"--coordinator") + 1].decode()
    return Path(address.removeprefix("ipc://")).parent if address.startswith("ipc://") else None


def test_worker_killed_mid_stream(tiny_tied, tmp_path):
    srv = ServerProcess(tiny_tied, tmp_path / "server.log", *LONG_CONTEXT)
    try:
        with Client(srv.address, timeout=HANG_S) as c:
            pids = c.info()["worker_pids"]
            assert pids and sorted(pids) == sorted(srv.workers)
            streams = [c.stream(list(range(10 + i, 40 + i)), LONG) for i in range(3)]
            outcome = {}
            t = generate_in_thread(srv.address, list(range(50, 80)), LONG, outcome)
            assert next(streams[0]).finish_reason is None  # mid-stream
            t0 = time.monotonic()
            os.kill(pids[0], signal.SIGKILL)
            for s in streams:
                with pytest.raises(EngineDeadError, match="worker"):
                    for _ in s:
                        pass
            t.join(HANG_S)
            assert isinstance(outcome.get("error"), EngineDeadError)
            assert time.monotonic() - t0 < HANG_S  # noticed, not left to the 600 s step timeout
        # the server does not stay up unhealthy: it exits non-zero, for a supervisor to restart it
        assert srv.proc.wait(HANG_S) == 1, srv.stderr()
    finally:
        srv.stop()


def test_worker_death_while_idle_ends_the_server(tiny_tied, tmp_path):
    srv = ServerProcess(tiny_tied, tmp_path / "server.log", *LONG_CONTEXT, "--token", "s3cret")
    try:
        # a token-protected server refuses requests without the right token
        for token in (None, "wrong"):
            with Client(srv.address, timeout=HANG_S, token=token) as c:
                with pytest.raises(ProtocolError, match="unauthorized"):
                    c.health()
                with pytest.raises(ProtocolError, match="unauthorized"):
                    c.generate("hello")
        with Client(srv.address, timeout=HANG_S, token="s3cret") as c:
            assert c.health()["healthy"]
            (pid,) = c.info()["worker_pids"]
            os.kill(pid, signal.SIGKILL)
        # found by the idle loop's health check (every second): the server exits non-zero
        assert srv.proc.wait(HANG_S) == 1, srv.stderr()
        assert "worker" in srv.stderr()
    finally:
        srv.stop()


def test_coordinator_killed_workers_exit(tiny_tied, tmp_path):
    srv = ServerProcess(tiny_tied, tmp_path / "server.log", *LONG_CONTEXT)
    ipc = None
    try:
        workers = children_of(srv.proc.pid)
        assert workers and sorted(workers) == sorted(srv.workers)
        ipc = _ipc_dir(workers[0])
        with Client(srv.address, timeout=HANG_S) as c:
            stream = c.stream(list(range(10, 40)), LONG)
            next(stream)  # a step in flight
            srv.proc.kill()
            srv.proc.wait(HANG_S)
            assert wait_gone(workers, HANG_S), [p for p in workers if pid_alive(p)]
            stream.close()
    finally:
        srv.stop()
        if ipc is not None:
            shutil.rmtree(ipc, ignore_errors=True)  # a killed coordinator cannot clean up after itself


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_graceful_shutdown(tiny_tied, tmp_path, sig):
    # --shutdown-timeout 0: no drain (tests/serving/test_drain.py has it), the requests in flight are aborted at once
    srv = ServerProcess(tiny_tied, tmp_path / "server.log", *LONG_CONTEXT, "--shutdown-timeout", "0")
    try:
        workers = list(srv.workers)
        ipc = _ipc_dir(workers[0])
        assert ipc is not None and ipc.exists()
        with Client(srv.address, timeout=HANG_S) as c:
            streams = [c.stream(list(range(10 + i, 40 + i)), LONG) for i in range(4)]
            done = {}
            t = generate_in_thread(srv.address, list(range(50, 80)), LONG, done)
            next(streams[0])
            deadline = time.monotonic() + HANG_S
            while c.stats()["pending"] < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            srv.proc.send_signal(sig)
            for s in streams:  # an error, not a normal end with finish_reason "abort"
                with pytest.raises(AbortedError, match="shutting down"):
                    list(s)
            t.join(60)
            assert isinstance(done.get("error"), AbortedError), done
            assert srv.proc.wait(HANG_S) == 0, srv.stderr()  # it exits by itself
        assert wait_gone(workers, 30)
        assert not ipc.exists()
        assert "Traceback" not in srv.stderr()
    finally:
        srv.stop()


def _http_request(client: httpx.Client, url: str, body: dict, out: list) -> None:
    """POST ``body``; ``out`` gets each SSE data line as it arrives (streamed) or the response, or the exception."""
    try:
        if not body.get("stream"):
            out.append(client.post(url, json=body))
            return
        with client.stream("POST", url, json=body) as r:
            out.extend(line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
    except Exception as e:
        out.append(e)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "systemd-stop"])
def test_signal_to_the_process_group_aborts_http_requests_and_exits_0(tiny_tied, tmp_path, sig):
    # a terminal's Ctrl-C (SIGINT) or systemd's stop (SIGTERM to the whole control group) reaches launch.py, its
    # workers and its front-end at once; the children leave it to launch.py, which aborts every request (no drain:
    # --shutdown-timeout 0) as for a signal to it alone: an error event or a 503, never a 200
    flags = ("--shutdown-timeout", "0")
    srv = HttpServer(tiny_tied, tmp_path / "server.log", *LONG_CONTEXT, *flags, new_session=True)
    clients: list[httpx.Client] = []
    try:
        children = children_of(srv.proc.pid)
        workers = [p for p in children if b"--coordinator" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert workers and len(children) == len(workers) + 1  # and the front-end
        ipc = _ipc_dir(workers[0])
        long = {"max_tokens": 1900, "ignore_eos": True}
        requests = [
            ("/completions", {"prompt": "a", "stream": True, **long}),
            ("/completions", {"prompt": [5, 6, 7], "stream": True, "n": 2, **long}),
            ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, **long}),
            ("/completions", {"prompt": "b", **long}),
        ]
        outs: list[list] = [[] for _ in requests]
        # clients made here: each one's set-up (its SSL context) in a thread of its own, beside a stream being read,
        # delayed that thread's request by up to seconds on a loaded 2-core machine
        clients += [httpx.Client(timeout=HANG_S) for _ in requests]
        threads = [
            threading.Thread(target=_http_request, args=(client, srv.base_url + path, body, out))
            for client, (path, body), out in zip(clients, requests, outs)
        ]
        for t in threads:
            t.start()
        with Client(srv.zmq, timeout=HANG_S) as c:
            deadline = time.monotonic() + HANG_S
            while (c.stats()["pending"] < 5 or not all(outs[:3])) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert all(outs[:3]) and not outs[3], outs  # every stream has begun, no request has ended
        os.killpg(srv.proc.pid, sig)
        for t in threads:
            t.join(30)
        for events in outs[:3]:
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            assert "error" in chunks[-1] and "abort" in chunks[-1]["error"]["message"], chunks[-2:]
            assert not [ch for c in chunks[:-1] for ch in c["choices"] if ch["finish_reason"] == "abort"]
        (response,) = outs[3]
        assert response.status_code == 503 and "abort" in response.text, response.text
        assert srv.proc.wait(HANG_S) == 0, srv.stderr()
        assert wait_gone(children, HANG_S), [p for p in children if pid_alive(p)]
        assert ipc is not None and not ipc.exists()
        # the only errors logged: the front-end's 5xx for the aborted requests
        errors = [line for line in srv.stderr().splitlines() if "ERROR" in line]
        assert all("503" in line and "abort" in line for line in errors), errors
    finally:
        for client in clients:
            client.close()
        srv.stop()


def test_port_in_use_fails_fast(tiny_tied):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), "--port", str(port), "--model", str(tiny_tied)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=START_S,
        )
    assert out.returncode == 1
    assert f"port {port}" in out.stderr and "in use" in out.stderr
    assert "listening" not in out.stdout  # refused before any model loaded
