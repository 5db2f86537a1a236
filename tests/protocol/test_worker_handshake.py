"""The worker handshake over a real ZMQ socket with a real worker process: it says hello with its rank, pid and
protocol version and exits when told to stop; a worker speaking another protocol version is refused with a
message naming both versions, and goes away by itself. With a worker secret, only workers that prove they hold it
get any work, and a worker works only for a coordinator that proves it holds it too."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import zmq

from protocol.codec import decode, encode
from protocol.messages import PROTOCOL_VERSION, AuthChallenge, AuthResponse, Shutdown, WorkerError, WorkerHello
from tests.support.builders import worker_config
from tests.support.processes import ROOT, free_port, wait_for_text
from tests.support.timeouts import HANG_S


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
    proc.wait(timeout=HANG_S)


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
        assert identity.startswith(b"rank0-") and len(identity) > 12  # random: no peer can take it first
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
        "from worker.__main__ import main\n"
        f"w.PROTOCOL_VERSION = {PROTOCOL_VERSION + 41}\n"
        f"sys.exit(main(['--coordinator', {ipc_address!r}, '--rank', '0', '--world-size', '1']))\n"
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


# ---- authentication (worker secret) --------------------------------------------------------------------------

SECRET = "s3cret-for-workers"


class FakeWorker(threading.Thread):
    """A peer speaking the worker protocol on a thread of this process, without the secret (or with a wrong
    proof): it records every message it is sent; once ``meddle`` is set it claims rank 0's failure, and with
    ``leave`` it then disconnects."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes, proof: bytes = b"", leave=False) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.proof, self.leave, self.got = proof, leave, []
        self.meddle, self.stop, self.done = threading.Event(), threading.Event(), threading.Event()
        self.sock.send(encode(WorkerHello(PROTOCOL_VERSION, 0, 1, "", os.getpid(), "impostor", b"n" * 32)))
        self.start()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.meddle.is_set() and not self.done.is_set():
                    self.sock.send(encode(WorkerError(0, "I am rank 0 now")))  # ignored: not an accepted worker
                    self.done.set()
                    if self.leave:
                        return  # a refused peer leaving is no engine death
                if not self.sock.poll(50):
                    continue
                data = self.sock.recv()
                msg = decode(data) if data else None
                self.got.append(type(msg).__name__ if msg else "probe")
                if isinstance(msg, AuthChallenge):  # answered with this peer's (bad) proof
                    self.sock.send(encode(AuthResponse(0, self.proof)))
        finally:
            self.sock.close(0)
            self.done.set()


def _worker_process(address: str, secret: str | None, log_path: Path) -> subprocess.Popen:
    env = _env()
    env.pop("NANOSERVE_API_KEY", None)
    env.pop("NANOSERVE_WORKER_SECRET", None)
    if secret is not None:
        env["NANOSERVE_WORKER_SECRET"] = secret
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with open(log_path, "w") as err:
        cmd = [sys.executable, "-m", "worker", "--coordinator", address]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=err)


def test_impostors_are_refused_and_the_real_worker_serves(tiny_tied, tmp_path, caplog):
    """Before the real rank 0: a peer without the secret that took the identity b"rank0", one whose proof is
    wrong, and a worker process with the wrong secret. Each is refused with a log line naming its address and
    never gets a config or a step; the real worker (the secret in its environment) serves, and the impostors'
    later messages and their disconnects change nothing."""
    from nanoserve import LLM, SamplingParams

    caplog.set_level(logging.WARNING, logger="nanoserve.workers")
    address = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    no_secret = FakeWorker(ctx, address, b"rank0", leave=True)
    wrong_proof = FakeWorker(ctx, address, b"rank0-guess", proof=b"x" * 32)
    wrong = _worker_process(address, "not-the-secret", tmp_path / "wrong.log")
    real = None
    try:
        wait_for_text(tmp_path / "wrong.log", "waiting for the coordinator", wrong)
        real = _worker_process(address, SECRET, tmp_path / "real.log")
        llm = LLM(
            str(tiny_tied), external_workers=True, worker_address=address, worker_secret=SECRET, max_model_len=128
        )
        with llm:
            params = SamplingParams(max_tokens=4, temperature=0)
            first = llm.generate("hello", params, use_tqdm=False)[0].token_ids
            for fake in (no_secret, wrong_proof):
                fake.meddle.set()
                assert fake.done.wait(60)
            port = int(address.rsplit(":", 1)[1])
            socket.create_connection(("127.0.0.1", port), timeout=30).close()  # a port scan: no engine death either
            time.sleep(0.5)  # the departure reaches the coordinator's monitor
            assert llm.generate("hello", params, use_tqdm=False)[0].token_ids == first
        assert wrong.wait(timeout=60) == 1
        assert "does not hold this worker's secret" in (tmp_path / "wrong.log").read_text()
        assert real.wait(timeout=60) == 0
    finally:
        for proc in (wrong, real):
            if proc is not None:
                _stop(proc)
        for fake in (no_secret, wrong_proof):
            fake.stop.set()
            fake.join(10)
        ctx.term()
    assert len(first) == 4
    assert no_secret.got == ["AuthChallenge", "Shutdown"], no_secret.got
    assert wrong_proof.got == ["AuthChallenge", "Shutdown"], wrong_proof.got
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a worker at 127.0.0.1")]
    assert any("'impostor'" in m and "no proof (no worker secret)" in m for m in refusals), refusals
    assert any("'impostor'" in m and "wrong worker secret" in m for m in refusals), refusals
    assert any(f"pid {wrong.pid}" in m and "worker secret differs" in m for m in refusals), refusals
    ignored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignoring a peer")]
    assert ignored, "the impostors' messages after their refusal were not logged"


def test_a_worker_without_the_secret_is_told_why(tiny_tied, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = _worker_process(address, None, tmp_path / "w.log")
    try:
        from coordinator.worker_group import WorkerGroup

        with pytest.raises(
            TimeoutError, match=r"rank\(s\) \[0\]; refused: a worker at 127.0.0.1.*holds no worker secret"
        ):
            WorkerGroup(worker_config(tiny_tied), 1, external=True, address=address, start_timeout_s=8, secret=SECRET)
        assert worker.wait(timeout=60) == 1
        assert "requires a worker secret: set NANOSERVE_WORKER_SECRET" in (tmp_path / "w.log").read_text()
    finally:
        _stop(worker)


def test_a_worker_with_a_secret_refuses_a_coordinator_without(ipc_address, tmp_path):
    """Mutual: a coordinator that cannot prove it holds the secret gets no work done by the worker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(ipc_address)
    worker = _worker_process(ipc_address, SECRET, tmp_path / "w.log")
    try:
        assert sock.poll(60_000), "no hello from the worker within 60 s"
        identity, _ = sock.recv_multipart()
        sock.send_multipart([identity, encode(AuthChallenge(b"c" * 32, b"not a proof"))])
        assert worker.wait(timeout=60) == 1
        assert "does not hold this worker's secret" in (tmp_path / "w.log").read_text()
    finally:
        _stop(worker)
        sock.close(0)
        ctx.term()


def test_non_loopback_worker_address_needs_a_secret(tiny_tied, monkeypatch):
    from coordinator.config import EngineArgError, EngineConfig

    monkeypatch.delenv("NANOSERVE_API_KEY", raising=False)
    monkeypatch.delenv("NANOSERVE_WORKER_SECRET", raising=False)
    kw = dict(model=str(tiny_tied), external_workers=True, device="cpu")
    for address in ("tcp://0.0.0.0:29600", "tcp://*:29600", "tcp://10.1.2.3:29600"):
        with pytest.raises(EngineArgError, match="is not a loopback address") as e:
            EngineConfig(worker_address=address, **kw)
        assert e.value.name == "worker_address"
    EngineConfig(worker_address="tcp://127.0.0.1:29600", **kw)
    assert EngineConfig(worker_address="tcp://0.0.0.0:29600", worker_secret="k", **kw).worker_secret == "k"
    monkeypatch.setenv("NANOSERVE_API_KEY", "the-api-key")  # the API key implies the worker secret
    assert EngineConfig(worker_address="tcp://0.0.0.0:29600", **kw).worker_secret == "the-api-key"
    assert "the-api-key" not in repr(EngineConfig(worker_address="tcp://0.0.0.0:29600", **kw))


def test_spawned_workers_get_the_secret_through_their_environment(tiny_tied, monkeypatch):
    """``--tp N`` workers: the secret in their environment, never in argv (any local user reads /proc/PID/cmdline);
    they prove it over the ipc socket like any other worker, and serve."""
    from nanoserve import LLM, SamplingParams

    monkeypatch.delenv("NANOSERVE_API_KEY", raising=False)
    monkeypatch.delenv("NANOSERVE_WORKER_SECRET", raising=False)
    with LLM(
        str(tiny_tied), tensor_parallel_size=2, device="cpu", worker_secret=SECRET, max_model_len=128, num_kv_blocks=32
    ) as llm:
        assert llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids
        for proc in llm.engine.workers.procs:
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert SECRET.encode() not in argv
            assert f"NANOSERVE_WORKER_SECRET={SECRET}".encode() in environ


def test_launch_refuses_a_public_worker_address_without_a_key(tiny_tied):
    """The flag is named; with --api-key on the command line (implying the worker secret) the same address is
    accepted, and the start-up only waits for workers (here: none come within a second)."""
    env = _env()
    env.pop("NANOSERVE_API_KEY", None)
    env.pop("NANOSERVE_WORKER_SECRET", None)
    base = [sys.executable, "launch.py", "--model", str(tiny_tied), "--port", "0", "--external-workers"]
    base += ["--worker-address", f"tcp://0.0.0.0:{free_port()}", "--worker-timeout-s", "1", "--device", "cpu"]
    out = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "argument --worker-address: worker_address 'tcp://0.0.0.0:" in out.stderr
    assert "is not a loopback address" in out.stderr
    out = subprocess.run([*base, "--api-key", "k"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "timed out waiting for hello from worker rank(s) [0]" in out.stderr, out.stderr
