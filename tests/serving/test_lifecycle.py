"""Honest exits of ``python launch.py``, with real processes: a child that dies unasked (the HTTP front-end, a
worker) fails the requests in flight and makes the launcher exit non-zero; SIGTERM with nothing in flight exits 0;
kill -9 of the launcher ends its front-end with a non-zero code and leaves its private dir, which the next start
removes while a live server's dir is untouched. Each test has a TMPDIR of its own (tempfile honours it), so that
tests running beside it neither see its dirs nor lose theirs; every deadline is only a guard on a loaded machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from client import Client, EngineDeadError, SamplingParams
from tests.support.processes import ROOT, children_of, pid_alive, wait_gone
from tests.support.server import ENGINE_ARGS, generate_in_thread
from tests.support.timeouts import HANG_S

LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # seconds of work: still running when hit
EXIT_S = 60  # "within seconds" on an idle machine; this only stops a hang on a loaded one

# launch.py under a child subreaper: when launch.py is SIGKILLed its children are reparented here, not to init, so
# their exit codes can be read ("reaped PID CODE", a negative code for a signal)
REAPER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
proc = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
print("launch pid", proc.pid, flush=True)
print("launch exit", proc.wait(), flush=True)
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    print("reaped", pid, os.waitstatus_to_exitcode(status), flush=True)
"""


class Launch:
    """``python launch.py --port 0 ...`` (under REAPER) with ``TMPDIR=tmp``; its stdout lines collected."""

    def __init__(self, model_dir, tmp: Path, log_path: Path, *extra: str) -> None:
        cmd = [sys.executable, "-c", REAPER, sys.executable, str(ROOT / "launch.py"), "--port", "0"]
        cmd += ["--model", str(model_dir), *ENGINE_ARGS, "--max-model-len", "2048", "--num-kv-blocks", "512", *extra]
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.reaper = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.lines: list[str] = []
        self.eof = threading.Event()
        self.children: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = int(self.wait_line("launch pid ").split()[-1])
        try:
            self.zmq = self.wait_line("nanoserve listening on ").split()[-1]
            http = "--http-port" in extra
            self.base_url = self.wait_line("nanoserve OpenAI API on ").split()[4] if http else None
            self.children = children_of(self.pid)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.reaper.stdout:
            self.lines.append(line.rstrip("\n"))
        self.eof.set()

    def wait_line(self, prefix: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while True:
            ended = self.eof.is_set()  # read before the lines: once set, every line is in
            found = [line for line in self.lines if line.startswith(prefix)]
            if found:
                return found[0]
            assert not ended, f"no {prefix!r}: the launcher ended:\n{self.lines}\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no {prefix!r} in {timeout} s:\n{self.lines}\n{self.stderr()}"
            time.sleep(0.05)

    def exit_code(self, timeout: float = EXIT_S) -> int:
        return int(self.wait_line("launch exit ", timeout).split()[-1])

    def reaped(self) -> dict[int, int]:
        """The launcher's orphans' exit codes (once the reaper has ended)."""
        self.reaper.wait(EXIT_S)
        assert self.eof.wait(EXIT_S)
        return {int(w[1]): int(w[2]) for w in (line.split() for line in self.lines) if w[:1] == ["reaped"]}

    def child(self, module: bytes) -> int:
        (pid,) = [p for p in self.children if module in Path(f"/proc/{p}/cmdline").read_bytes()]
        return pid

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        for pid in [self.pid, *self.children]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.reaper.wait(EXIT_S)
        self.reaper.stdout.close()
        self.log.close()


def _private_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("nanoserve-*"))


@pytest.fixture
def tmp() -> Iterator[Path]:
    # short: the worker socket's ipc:// path inside it must fit a Unix socket address (107 bytes)
    path = Path(tempfile.mkdtemp(prefix="lifecycle-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_front_end_killed_fails_requests_and_the_launcher_exits_1(tiny_tied, tmp, tmp_path):
    srv = Launch(tiny_tied, tmp, tmp_path / "server.log", "--http-port", "0")
    try:
        front_end = srv.child(b"openai_server")
        assert len(_private_dirs(tmp)) == 2  # the workers' and the front-end's socket's
        with Client(srv.zmq, timeout=HANG_S) as c:
            stream = c.stream(list(range(10, 40)), LONG)
            assert next(stream).finish_reason is None  # mid-stream
            os.kill(front_end, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="HTTP front-end exited with code -9"):
                for _ in stream:
                    pass
        assert srv.exit_code() == 1, srv.stderr()
        (reason,) = [line for line in srv.stderr().splitlines() if "exiting with code 1" in line]
        assert "HTTP front-end exited with code -9" in reason, reason
        assert wait_gone(srv.children, HANG_S)
        assert _private_dirs(tmp) == [] and list(tmp.iterdir()) == []
    finally:
        srv.stop()


def test_worker_killed_fails_requests_and_the_launcher_exits_1(tiny_tied, tmp, tmp_path):
    srv = Launch(tiny_tied, tmp, tmp_path / "server.log")
    try:
        (worker,) = srv.children
        with Client(srv.zmq, timeout=HANG_S) as c:
            stream = c.stream(list(range(10, 40)), LONG)
            outcome = {}
            t = generate_in_thread(srv.zmq, list(range(50, 80)), LONG, outcome)
            deadline = time.monotonic() + HANG_S
            while c.stats()["pending"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert next(stream).finish_reason is None
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="worker"):
                for _ in stream:
                    pass
            t.join(EXIT_S)
            assert isinstance(outcome.get("error"), EngineDeadError), outcome
        assert srv.exit_code() == 1, srv.stderr()
        (reason,) = [line for line in srv.stderr().splitlines() if "exiting with code 1" in line]
        assert "worker" in reason, reason
        assert _private_dirs(tmp) == [] and list(tmp.iterdir()) == []
    finally:
        srv.stop()


def _stream_http(url: str, out: list) -> None:
    body = {"prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/completions", json=body, timeout=EXIT_S) as r:
            if r.status_code != 200:
                out.append(f"status {r.status_code}: {r.read()!r}")
            out.extend(x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: "))
    except Exception as e:
        out.append(e)


def test_kill_9_of_the_launcher_leaves_a_dir_the_next_start_removes(tiny_tied, tmp, tmp_path):
    live = Launch(tiny_tied, tmp, tmp_path / "live.log")
    servers = [live]
    try:
        (live_dir,) = _private_dirs(tmp)
        killed = Launch(tiny_tied, tmp, tmp_path / "killed.log", "--http-port", "0")
        servers.append(killed)
        killed_dirs = set(_private_dirs(tmp)) - {live_dir}
        assert len(killed_dirs) == 2  # the workers' and the front-end's socket's
        front_end = killed.child(b"openai_server")
        events: list = []
        reader = threading.Thread(target=_stream_http, args=(killed.base_url, events))
        reader.start()
        deadline = time.monotonic() + HANG_S
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(events) >= 3 and events[0].startswith("{"), events  # mid-stream
        os.kill(killed.pid, signal.SIGKILL)
        reader.join(EXIT_S)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
        assert killed.exit_code() == -signal.SIGKILL
        codes = killed.reaped()  # its front-end and worker, orphaned
        assert set(codes) == set(killed.children) and codes[front_end] == 1, (codes, killed.lines)
        assert all(d.exists() for d in killed_dirs) and live_dir.exists()  # kill -9: nothing could clean up

        nxt = Launch(tiny_tied, tmp, tmp_path / "next.log")
        servers.append(nxt)
        assert not any(d.exists() for d in killed_dirs)  # the next start removed them...
        assert live_dir.exists()  # ...and not the live server's
        with Client(live.zmq, timeout=HANG_S) as c:
            assert c.generate("hello", SamplingParams(temperature=0, max_tokens=4)).token_ids
        assert len(_private_dirs(tmp)) == 2
        for srv in (live, nxt):  # SIGTERM with nothing in flight: a clean, requested shutdown
            os.kill(srv.pid, signal.SIGTERM)
        for srv in (live, nxt):
            assert srv.exit_code() == 0, srv.stderr()
            assert wait_gone(srv.children, HANG_S), [p for p in srv.children if pid_alive(p)]
        assert list(tmp.iterdir()) == []
    finally:
        for srv in servers:
            srv.stop()
