"""The ZMQ clients never wait forever: with no server at the address, or once the server died, a call fails with
ConnectionError naming the address after ``connect_timeout``; a live server that takes long is waited for."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import zmq

from client import AsyncClient, Client
from protocol.client_messages import Health, HealthReply
from protocol.codec import decode, encode
from tests.support.timeouts import HANG_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlowServer:
    """A ROUTER that answers Health after ``delay`` seconds, or never (``delay=None``), until stopped."""

    def __init__(self, delay: float | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.delay, self.stopped, self.got = delay, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            if not self.sock.poll(50):
                continue
            identity, data = self.sock.recv_multipart()
            msg = decode(data)
            self.got.set()
            if isinstance(msg, Health) and self.delay is not None:
                end = time.monotonic() + self.delay
                while time.monotonic() < end and not self.stopped.is_set():
                    time.sleep(0.05)
                self.sock.send_multipart([identity, encode(HealthReply(msg.request_id, True, "ok"))])

    def stop(self) -> None:
        """The server dies: its socket closes (the kernel drops the connection)."""
        self.stopped.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def test_no_server_fails_naming_the_address():
    address = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with Client(address, connect_timeout=1.0) as c, pytest.raises(ConnectionError, match=address):
        c.health()
    assert time.monotonic() - t0 < HANG_S  # not forever: connect_timeout, not a reply timeout, ends it

    async def main():
        async with AsyncClient(address, connect_timeout=1.0) as c:
            await c.health()

    with pytest.raises(ConnectionError, match=address):
        asyncio.run(asyncio.wait_for(main(), HANG_S))


def test_a_server_that_dies_fails_the_call_and_a_slow_one_does_not():
    slow = SlowServer(delay=2.5)  # longer than connect_timeout: a live connection is never timed out
    try:
        with Client(slow.address, connect_timeout=1.0) as c:
            assert c.health()["healthy"]

        async def main():
            async with AsyncClient(slow.address, connect_timeout=1.0) as c:
                return await c.health()

        assert asyncio.run(main())["healthy"]
    finally:
        slow.stop()

    dying = SlowServer(delay=None)  # takes the request and never answers; then dies
    with Client(dying.address, connect_timeout=1.0) as c:
        threading.Timer(1.0, dying.stop).start()
        with pytest.raises(ConnectionError, match=dying.address):
            c.health()
    assert dying.got.is_set()
