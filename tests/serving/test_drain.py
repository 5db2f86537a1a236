"""SIGTERM drains (``launch.py --shutdown-timeout``): new requests are refused with AbortedError, the ones in flight
run to their end, and those still running past the timeout (or at a second signal) get AbortedError, streamed or
not, never a normal end with finish_reason "abort". Real ``launch.py`` processes, the real Client. And
``Server.fail`` (a child died): EngineDeadError for what is in flight, the loop ends with ``failure`` set."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from client import AbortedError, Client, EngineDeadError, SamplingParams
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.server import Server
from tests.support.server import ENGINE_KWARGS, ServerProcess, generate_in_thread

LONG_CONTEXT = ["--max-model-len", "2048", "--num-kv-blocks", "1024"]
LONG = SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True)  # still running when the signal comes
EXIT_S = 60  # a guard on a loaded machine, not a speed


def _wait_shutting_down(c: Client) -> None:
    deadline = time.monotonic() + EXIT_S
    while c.health()["healthy"]:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.05)
    assert c.health()["message"] == "shutting down"


def test_drain_lets_running_requests_finish_and_refuses_new_ones(tiny_tied, tmp_path):
    srv = ServerProcess(tiny_tied, tmp_path / "server.log", *LONG_CONTEXT, "--shutdown-timeout", "600")
    try:
        with Client(srv.address, timeout=EXIT_S) as c:
            params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
            stream = c.stream(list(range(10, 40)), params)
            out: dict = {}
            t = generate_in_thread(srv.address, list(range(50, 80)), params, out)
            first = next(stream)
            assert first.finish_reason is None
            deadline = time.monotonic() + EXIT_S
            while c.stats()["pending"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            srv.proc.send_signal(signal.SIGTERM)
            _wait_shutting_down(c)
            with pytest.raises(AbortedError, match="shutting down"):
                c.generate("hello")
            with pytest.raises(AbortedError, match="shutting down"):
                list(c.stream("hello"))
            deltas = [first, *stream]
            assert deltas[-1].finish_reason == "length"
            assert len(stream.completion.token_ids) == 300
            t.join(EXIT_S)
            assert out["completion"].finish_reason == "length" and len(out["completion"].token_ids) == 300
        assert srv.proc.wait(EXIT_S) == 0, srv.stderr()
        assert "Traceback" not in srv.stderr()
    finally:
        srv.stop()


@pytest.mark.parametrize("second_signal", [False, True], ids=["past-the-timeout", "second-signal"])
def test_requests_left_at_the_end_of_a_drain_get_aborted_error(tiny_tied, tmp_path, second_signal):
    timeout = "600" if second_signal else "1"
    srv = ServerProcess(tiny_tied, tmp_path / "server.log", *LONG_CONTEXT, "--shutdown-timeout", timeout)
    try:
        with Client(srv.address, timeout=EXIT_S) as c:
            stream = c.stream(list(range(10, 40)), LONG)
            out: dict = {}
            t = generate_in_thread(srv.address, list(range(50, 80)), LONG, out)
            assert next(stream).finish_reason is None
            deadline = time.monotonic() + EXIT_S
            while c.stats()["pending"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            if second_signal:
                _wait_shutting_down(c)
                srv.proc.send_signal(signal.SIGTERM)
            with pytest.raises(AbortedError, match="shutting down"):
                for _ in stream:
                    pass
            t.join(EXIT_S)
            assert isinstance(out.get("error"), AbortedError), out
            assert time.monotonic() - t0 < EXIT_S
        assert srv.proc.wait(EXIT_S) == 0, srv.stderr()
        assert "Traceback" not in srv.stderr()
    finally:
        srv.stop()


def test_fail_ends_the_loop_with_engine_dead_errors_and_failure_set(tiny_tied):
    # what the launcher calls when a child dies unasked (the HTTP front-end): from another thread, at once
    engine = Engine(EngineConfig(model=str(tiny_tied), **ENGINE_KWARGS))
    server = Server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve, args=(engine,), daemon=True)
    thread.start()
    try:
        with Client(server.address, timeout=EXIT_S) as c:
            stream = c.stream([5, 6, 7], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
            assert next(stream).finish_reason is None
            server.fail("the HTTP front-end exited with code -9")
            with pytest.raises(EngineDeadError, match="front-end exited with code -9"):
                list(stream)
        thread.join(EXIT_S)
        assert not thread.is_alive() and server.failure == "the HTTP front-end exited with code -9"
    finally:
        server.stop()
        thread.join(EXIT_S)
        engine.shutdown()
        server.close(0)
