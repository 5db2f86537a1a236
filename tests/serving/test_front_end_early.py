"""launch.py --http-port spawns the HTTP front-end before the engine starts (nanoserve/serve.py), so that its imports
run beside the coordinator's and the workers' instead of after them: it is up while no worker has joined yet, waits
for the engine however long that takes, and prints its line only after launch.py's own; requests then go through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from openai import OpenAI

from benchmarks.pipe_lines import PipeLines
from tests.support.announced import LISTENING, OPENAI_API
from tests.support.processes import ROOT, children_of, free_port
from tests.support.timeouts import HANG_S, START_S


def _front_end_of(pid: int) -> int | None:
    for child in children_of(pid):
        try:
            if b"openai_server" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    return None


def _external_worker(address: str) -> subprocess.Popen:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    cmd = [sys.executable, "-m", "worker", "--coordinator", address]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)


def _lines_until(proc: subprocess.Popen, prefix: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    reader = PipeLines(proc.stdout)
    try:
        while not any(line.startswith(prefix) for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, (proc.returncode, lines)
            lines += reader.poll(0.2)
    finally:
        reader.close()
    return lines[: next(i for i, line in enumerate(lines) if line.startswith(prefix)) + 1]


def test_the_front_end_is_up_before_any_worker_joins_and_serves_once_the_engine_is(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path / "launch.log", "w")
    cmd = [sys.executable, "launch.py", "--port", "0", "--http-port", "0", "--device", "cpu", "--external-workers",
           "--worker-address", address, "--max-model-len", "256", "--num-kv-blocks", "32"]  # fmt: skip
    launch = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
    worker = None
    try:
        deadline = time.monotonic() + HANG_S
        while (front_end := _front_end_of(launch.pid)) is None:  # no worker yet: the engine cannot be ready
            assert launch.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            time.sleep(0.05)
        worker = _external_worker(address)
        lines = _lines_until(launch, OPENAI_API, START_S)
        assert [line.split()[0:3] for line in lines if line.startswith(LISTENING)], lines  # its line came first
        assert _front_end_of(launch.pid) == front_end  # the same process, not a second one
        url = lines[-1].split()[4]
        client = OpenAI(base_url=url, api_key="none", timeout=HANG_S, max_retries=0)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="def f(x):", max_tokens=4, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens == 4
        launch.send_signal(signal.SIGTERM)
        assert launch.wait(HANG_S) == 0, (tmp_path / "launch.log").read_text()
    finally:
        for proc in (launch, worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        log.close()
