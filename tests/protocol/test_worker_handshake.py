"""The worker handshake over a real ZMQ socket with a real worker process: it says hello with its rank, pid and
protocol version and exits when told to stop; a worker speaking another protocol version is refused with a
message naming both versions, and goes away by itself."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from protocol.codec import decode, encode
from protocol.messages import PROTOCOL_VERSION, Shutdown, WorkerHello
from tests.support.builders import worker_config
from tests.support.processes import ROOT


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


@pytest.fixture
def ipc_address():
    d = tempfile.mkdtemp(prefix="nanoserve-test-")
    yield f"ipc://{d}/sock"
    for f in Path(d).iterdir():
        f.unlink()
    os.rmdir(d)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_worker_says_hello(ipc_address):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(ipc_address)
    cmd = [sys.executable, "-m", "worker", "--coordinator", ipc_address, "--rank", "0", "--world-size", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL)
    try:
        assert sock.poll(60_000), "no hello from the worker within 60 s"
        identity, data = sock.recv_multipart()
        hello = decode(data, expect=WorkerHello)
        assert identity == b"rank0"
        assert hello.protocol_version == PROTOCOL_VERSION
        assert (hello.rank, hello.world_size, hello.pid) == (0, 1, proc.pid)
        assert hello.hostname
        # told to stop before any config, it exits by itself
        sock.send_multipart([identity, encode(Shutdown("test over"))])
        assert proc.wait(timeout=30) == 1
    finally:
        _stop(proc)
        sock.close(0)
        ctx.term()


def test_protocol_version_mismatch_is_refused(ipc_address, tiny_tied):
    from coordinator.worker_group import WorkerGroup

    code = (
        "import sys\n"
        "import worker.worker as w\n"
        f"w.PROTOCOL_VERSION = {PROTOCOL_VERSION + 41}\n"
        f"sys.exit(w.main(['--coordinator', {ipc_address!r}, '--rank', '0', '--world-size', '1']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="protocol version mismatch") as e:
            WorkerGroup(worker_config(tiny_tied), 1, external=True, address=ipc_address, start_timeout_s=60)
        assert f"speaks {PROTOCOL_VERSION + 41}" in str(e.value) and f"speaks {PROTOCOL_VERSION}" in str(e.value)
        assert time.monotonic() - t0 < 60
        # the worker was told why and went away on its own
        assert proc.wait(timeout=30) == 1
    finally:
        _stop(proc)
