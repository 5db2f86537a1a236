"""The coordinator's local socket for its HTTP front-end (coordinator/local_socket.py, client/local_link.py): the real
Server in this process over a stand-in engine, reached over a real Unix socket by the real AsyncClient or by a bare
socket speaking the framing by hand; and the launcher's front-end using it."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
import time

import pytest

import coordinator.server as server_module
from client.async_client import AsyncClient
from coordinator.server import Server
from protocol.client_messages import CLIENT_PROTOCOL_VERSION, Delta, Generate, Tokenize, TokenizeReply
from protocol.codec import decode, encode
from protocol.outputs import StepOutput
from protocol.sampling_params import SamplingParams
from protocol.stream_frames import FrameBuffer, FrameTooLargeError, append_framed
from tests.serving.test_server_wakeup import QuickEngine
from tests.support.timeouts import HANG_S


def framed(data: bytes) -> bytes:
    """``data`` as one message of the stream, as a bare client writes it."""
    buf = bytearray()
    append_framed(buf, data)
    return bytes(buf)


BIG_IDS = 3_000_000  # a Tokenize reply of ~9 MB: far over a Unix socket's buffer, so it goes out in many writes


class HoldingEngine(QuickEngine):
    """Streams never finish on their own (a request only ends when aborted); tokenizing a text gives 3M ids."""

    def __init__(self) -> None:
        super().__init__()
        self.running: set[str] = set()
        self.aborted: list[str] = []

    def add_admitted(self, ids, params, engine_id, stream=False) -> None:
        self.running.add(engine_id)
        self.new.append(engine_id)

    def step(self) -> list[StepOutput]:
        outs = [StepOutput(rid, [7], "x") for rid in self.new]
        self.new = []
        return outs

    @property
    def has_unfinished(self) -> bool:
        return bool(self.new)

    def abort(self, request_id):
        self.running.discard(request_id)
        self.aborted.append(request_id)
        return StepOutput(request_id, [], "", finish_reason="abort")

    def tokenize(self, msg) -> TokenizeReply:
        return TokenizeReply(msg.request_id, list(range(BIG_IDS)), 4096)


@pytest.fixture
def served(monkeypatch):
    # a loop that waited for its poll timeout to write the rest of a long reply now waits an hour: it hangs
    monkeypatch.setattr(server_module, "IDLE_POLL_MS", 3_600_000)
    srv = Server("127.0.0.1", 0, max_message_bytes=64 << 20)
    address = srv.listen_locally()
    engine = HoldingEngine()
    thread = threading.Thread(target=srv.serve, args=(engine,), daemon=True)
    thread.start()
    yield srv, address, engine
    srv.stop()
    srv.stop()
    thread.join(HANG_S)
    srv.close(0)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_socket_lives_in_a_private_directory_removed_at_close():
    srv = Server("127.0.0.1", 0)
    address = srv.listen_locally()
    path = address.removeprefix("unix:")
    assert address.startswith("unix:") and stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    srv.close(0)
    assert not os.path.exists(os.path.dirname(path))


def test_requests_and_replies_both_ways_including_large_ones(served):
    srv, address, engine = served

    async def run():
        c = AsyncClient(address, max_message_bytes=srv.max_message_bytes)
        try:
            health = await asyncio.wait_for(c.health(), HANG_S)
            prompt = list(range(2_000_000))  # ~6 MB: many writes, the writer on the client's loop sends the rest
            stream = c.stream(prompt, SamplingParams(max_tokens=4))
            first = await asyncio.wait_for(anext(stream), HANG_S)
            await stream.aclose()
            return health, first
        finally:
            c.close()

    health, first = asyncio.run(run())
    assert health["healthy"] is True
    assert isinstance(first, Delta) and first.token_ids == [7] and first.text == "x"
    _wait_for(lambda: len(engine.aborted) == 1, "the stream left early was never aborted")
    # a ~9 MB reply to a bare socket (no keep-alives to wake the loop): the idle loop writes it as room comes
    sock = _raw_connection(address)
    sock.sendall(framed(encode(Tokenize(CLIENT_PROTOCOL_VERSION, "t", None, "hello", True))))
    frames, got = FrameBuffer(1 << 30), []
    while not got:
        frames.feed(sock.recv(1 << 20))
        got = frames.take()
    sock.close()
    reply = decode(got[0])
    assert isinstance(reply, TokenizeReply) and reply.token_ids == list(range(BIG_IDS))


def _raw_connection(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address.removeprefix("unix:"))
    sock.settimeout(HANG_S)
    return sock


def _generate(rid: str) -> bytes:
    return framed(encode(Generate(CLIENT_PROTOCOL_VERSION, rid, None, [1, 2, 3], True, SamplingParams())))


def test_a_connection_that_closes_has_its_requests_aborted_at_once(served):
    srv, address, engine = served
    sock = _raw_connection(address)
    sock.sendall(_generate("a") + _generate("b"))
    frames = FrameBuffer(1 << 20)
    got: list = []
    while len(got) < 2:
        frames.feed(sock.recv(1 << 16))
        got += [decode(m) for m in frames.take()]
    assert sorted(d.request_id for d in got) == ["a", "b"] and not engine.aborted
    sock.close()  # no heartbeat timeout involved: the server sees the end of the stream
    _wait_for(lambda: len(engine.aborted) == 2, "the requests of a closed connection were left running")
    assert not engine.running


def test_a_message_over_the_limit_drops_its_connection_and_the_server_goes_on(served):
    srv, address, engine = served
    sock = _raw_connection(address)
    sock.sendall((srv.max_message_bytes + 1).to_bytes(4, "little"))
    assert sock.recv(1) == b""  # dropped before any body was sent
    sock.close()

    async def health():
        c = AsyncClient(address)
        try:
            return await asyncio.wait_for(c.health(), HANG_S)
        finally:
            c.close()

    assert asyncio.run(health())["healthy"] is True


def test_the_client_fails_at_once_when_the_server_end_closes(tmp_path):
    path = str(tmp_path / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def close_the_first_connection():
        conn, _ = listener.accept()
        conn.recv(1 << 16)  # the request arrives, then the "server" goes away
        conn.close()

    t = threading.Thread(target=close_the_first_connection, daemon=True)
    t.start()

    async def ask():
        c = AsyncClient(f"unix:{path}")
        try:
            await asyncio.wait_for(c.health(), HANG_S)
        finally:
            c.close()

    with pytest.raises(ConnectionError, match="closed the connection"):
        asyncio.run(ask())
    t.join(HANG_S)
    listener.close()


def test_no_server_at_the_path_is_a_connection_error(tmp_path):
    with pytest.raises(ConnectionError, match="no server answers at unix:"):
        AsyncClient(f"unix:{tmp_path / 'nothing'}")


def test_frames_split_anywhere_come_out_whole_and_a_long_length_is_refused():
    messages = [b"", b"a", bytes(range(256)) * 40, b"xyz"]
    stream = b"".join(framed(m) for m in messages)
    for cut in range(0, len(stream), 37):
        buf, out = FrameBuffer(1 << 20), []
        for part in (stream[:cut], stream[cut : cut + 5], stream[cut + 5 :]):
            buf.feed(part)
            out += buf.take()
        assert out == messages and buf.buffered == 0
    buf = FrameBuffer(100)
    buf.feed(framed(b"x" * 101)[:4])
    with pytest.raises(FrameTooLargeError):
        buf.take()
