"""The coordinator's loop wakes when a tokenizer thread finishes, not at its next poll timeout: with every poll
timeout of coordinator/server.py set to an hour, a Tokenize, a Detokenize and a Generate of a long text (all three
go to the tokenizer threads) are still answered. The real Server in this process over a stand-in engine (answers at
once, no model); the requests come from a bare ZMQ socket, since the clients' keep-alives (one a second while a
request is in flight) would wake the loop themselves."""

from __future__ import annotations

import threading

import pytest
import zmq

import coordinator.server as server_module
from coordinator.server import Server
from coordinator.tokenizer_pool import INLINE_CHARS
from protocol.client_messages import (
    CLIENT_PROTOCOL_VERSION,
    Delta,
    Detokenize,
    DetokenizeReply,
    Generate,
    Health,
    HealthReply,
    Tokenize,
    TokenizeReply,
)
from protocol.codec import decode, encode
from protocol.outputs import StepOutput
from protocol.sampling_params import SamplingParams
from tests.support.timeouts import HANG_S

HOUR_MS = 3_600_000


class QuickEngine:
    """The engine interface the Server drives: every request gets one token on the next step, and ends."""

    def __init__(self) -> None:
        self.new: list[str] = []

    def admit(self, prompt, params):
        return [len(prompt)], params

    def add_admitted(self, ids, params, engine_id, stream=False) -> None:
        self.new.append(engine_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.new)

    def step(self) -> list[StepOutput]:
        outs = [StepOutput(rid, [7], "x", finish_reason="length", prompt_token_ids=[1]) for rid in self.new]
        self.new = []
        return outs

    def tokenize(self, msg) -> TokenizeReply:
        return TokenizeReply(msg.request_id, [1, 2, 3], 4096)

    def detokenize(self, msg) -> DetokenizeReply:
        return DetokenizeReply(msg.request_id, "abc", None)

    def abort(self, request_id):
        return None

    def stats(self) -> dict:
        return {"output_tokens": 0}

    def health(self) -> None:
        return None


@pytest.fixture
def server(monkeypatch):
    for name in ("IDLE_POLL_MS", "TOKENIZING_POLL_MS"):  # a wake that waits for a timeout now waits an hour
        monkeypatch.setattr(server_module, name, HOUR_MS, raising=False)
    srv = Server("127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve, args=(QuickEngine(),), daemon=True)
    thread.start()
    yield srv
    srv.stop()
    srv.stop()
    srv.fail("test over")  # ends the loop even while it sleeps in a poll: the wake-up is what is under test
    thread.join(HANG_S)
    srv.close(0)


def ask(sock: zmq.Socket, msg):
    """Send one request and return its reply (a hang fails at HANG_S)."""
    sock.send(encode(msg))
    assert sock.poll(int(HANG_S * 1000)), f"no reply to {type(msg).__name__} within {HANG_S} s"
    return decode(sock.recv())


def test_tokenizer_thread_results_wake_the_loop(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.address)
    v = CLIENT_PROTOCOL_VERSION
    try:
        assert isinstance(ask(sock, Health(v, "h", None)), HealthReply)  # the loop sleeps in its idle poll from here
        assert ask(sock, Tokenize(v, "t1", None, "hello", True)).token_ids == [1, 2, 3]
        assert ask(sock, Detokenize(v, "d1", None, [1, 2], False, True)).text == "abc"
        long_text = "word " * (INLINE_CHARS // 5 + 10)  # over the inline limit: tokenized on a thread
        out = ask(sock, Generate(v, "g1", None, long_text, False, SamplingParams(max_tokens=1)))
        assert isinstance(out, Delta) and out.token_ids == [7] and out.finish_reason == "length"
        assert ask(sock, Tokenize(v, "t2", None, "again", True)).token_ids == [1, 2, 3]
    finally:
        sock.close(linger=0)
        ctx.term()
