"""Clients for a running nanoserve server (``python launch.py``): ``Client`` (blocking, here) and ``AsyncClient``
(asyncio, client/async_client.py). Both talk msgpack records (protocol/client_messages.py) over one ZMQ DEALER
socket and keep any number of requests in flight at once; replies are matched to requests by request id.

    with Client("tcp://127.0.0.1:8765") as c:
        print(c.generate("Hello", SamplingParams(max_tokens=32)).text)
        for delta in c.stream("Hello"):
            print(delta.text, end="", flush=True)

Leaving a stream early (``break``, ``close()``, garbage collection) or cancelling the asyncio task that waits on
a request aborts the request on the server, which frees its KV blocks. Errors come back as exceptions:
``RequestError`` (the message names the field; ``MessageTooLargeError`` for a request over the server's
``--max-message-bytes``, refused before it is sent), ``EngineDeadError``, ``OverloadedError``, ``ProtocolError``,
and the built-in ``TimeoutError`` for a client-side timeout. Neither client is thread-safe: use one per thread.

While requests are in flight, a client sends the server a KeepAlive every second (``Client`` from a thread of its
own, so a caller that does not read for a while keeps its requests): the server aborts the requests of a client
silent for its ``--client-heartbeat-timeout``. ``client=`` labels requests for the server's per-client pending limit
(``--max-pending-per-client``), which counts per connection and label: a front-end serving many users over one
connection names each user.
"""

from __future__ import annotations

import collections
import threading
import time

import zmq

from client.base import DEFAULT_ADDRESS, _as_dict, _Base, chat_prompt
from client.liveness import DEFAULT_CONNECT_TIMEOUT_S, start_keepalive_thread
from client.replies import Accumulator, StreamState, decode_reply, raise_error
from protocol.client_messages import Abort, Delta, Error, Health, Info, Stats
from protocol.outputs import Completion
from protocol.sampling_params import SamplingParams

__all__ = ["Client", "Stream", "Delta", "DEFAULT_ADDRESS", "chat_prompt"]

_POLL_MS = 200


# ---- blocking client ---------------------------------------------------------------------------------------


class Client(_Base):
    """Blocking client. ``timeout`` (seconds, None = forever) bounds every wait for the server's next reply;
    when it passes, the request is aborted and ``TimeoutError`` raised. Independently, a wait fails with
    ``ConnectionError`` once no server has been connected for ``connect_timeout`` seconds (none at the address,
    or it died); a live server is never timed out by that, however long a generation takes. A request larger than
    ``max_message_bytes`` (default: the server's default 8 MiB; ``info()`` learns the server's own) raises
    ``MessageTooLargeError`` before it is sent."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout: float | None = None,
        token: str | None = None,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
        max_message_bytes: int | None = None,
    ):
        super().__init__(zmq.Context(), address, token, timeout, connect_timeout, max_message_bytes)
        self._inbox: dict[str, collections.deque] = {}  # replies of the requests in flight
        # the socket is used from the caller's thread and the keep-alive thread, one at a time; reentrant, since a
        # stream dropped (garbage collected) while the caller's thread holds it sends its abort then
        self._lock = threading.RLock()
        self._keepalive_stop = threading.Event()
        self._keepalive: threading.Thread | None = None

    # ---- plumbing --------------------------------------------------------------------------------------------

    def _send(self, msg, flags: int = 0) -> None:
        data = self._encode(msg)
        with self._lock:
            self._sock.send(data, flags)
            self._last_sent = time.monotonic()

    def _beat(self) -> None:
        """The keep-alive thread's turn: a KeepAlive while requests are in flight. Skipped while the caller's thread
        holds the socket (it is then waiting for a reply in ``_next``, which sends them itself)."""
        if not self._inbox or not self._lock.acquire(blocking=False):
            return
        try:
            data = None if self._sock.closed else self._keepalive_frame()
            if data is not None:
                self._sock.send(data, zmq.NOBLOCK)
                self._last_sent = time.monotonic()
        except zmq.ZMQError:
            pass
        finally:
            self._lock.release()

    def _open(self, msg) -> str:
        if self._keepalive is None:
            self._keepalive = start_keepalive_thread(self, Client._beat, self._keepalive_stop)
        self._inbox[msg.request_id] = collections.deque()
        try:
            self._send(msg)
        except BaseException:
            self._inbox.pop(msg.request_id, None)
            raise
        return msg.request_id

    def _next(self, rid: str, deadline: float | None = None):
        """The next reply for ``rid``; replies for other requests in flight are queued for them."""
        q = self._inbox[rid]
        if deadline is None and self.timeout is not None:
            deadline = time.monotonic() + self.timeout
        while not q:
            wait = _POLL_MS if deadline is None else min(_POLL_MS, max(0, int((deadline - time.monotonic()) * 1000)))
            with self._lock:
                data = self._sock.recv() if self._sock.poll(wait) else None
                keepalive = self._keepalive_frame()
                if keepalive is not None:
                    self._sock.send(keepalive)
                    self._last_sent = time.monotonic()
            if data is not None:
                self._dispatch(data)
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no reply from {self.address} within {self.timeout} s (request {rid})")
            self._watch.drain()
            if (err := self._watch.error()) is not None:
                raise err
        return q.popleft()

    def _dispatch(self, data: bytes) -> None:
        msg, rid = decode_reply(data)
        q = self._inbox.get(rid)
        if q is not None:
            q.append(msg)  # else: a late reply to a request we gave up on (or a malformed one)

    def _abort_quietly(self, rid: str) -> None:
        if self._inbox.pop(rid, None) is not None and not self._sock.closed:
            try:
                self._send(self._control(Abort, rid), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _call(self, cls) -> dict:
        return _as_dict(self._ask(self._control(cls, self._new_id())))

    def _ask(self, msg):
        rid = self._open(msg)
        try:
            reply = self._next(rid)
        finally:
            self._inbox.pop(rid, None)
        if isinstance(reply, Error):
            raise_error(reply)
        return reply

    # ---- API -------------------------------------------------------------------------------------------------

    def generate(self, prompt, params: SamplingParams | None = None, client: str = "") -> Completion:
        """One completion (the server sends it whole when it is finished). ``client``: whom the request is for,
        within this connection (the per-client pending limit counts per connection and label)."""
        rid = self._open(self._labelled_request(prompt, params, False, client))
        try:
            reply = self._next(rid)
        except BaseException:
            self._abort_quietly(rid)
            raise
        self._inbox.pop(rid, None)
        if isinstance(reply, Error):
            raise_error(reply)
        return Accumulator(rid).add(reply)

    def generate_many(self, prompts: list, params=None, client: str = "") -> list[Completion]:
        """Completions in input order; every request is sent before the first reply is awaited."""
        msgs, rids, out = self._generate_requests(prompts, params, client), [], []
        try:
            for m in msgs:  # one refused (e.g. too large) aborts those already sent
                rids.append(self._open(m))
            for rid in rids:
                reply = self._next(rid)
                self._inbox.pop(rid, None)
                if isinstance(reply, Error):
                    raise_error(reply)
                out.append(Accumulator(rid).add(reply))
        except BaseException:
            for rid in rids:
                self._abort_quietly(rid)
            raise
        return out

    def stream(self, prompt, params: SamplingParams | None = None, client: str = "") -> Stream:
        """Send the request now; iterate the result for its deltas (the last has ``finish_reason`` set)."""
        rid = self._open(self._labelled_request(prompt, params, True, client))
        return Stream(self, rid)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, chat_template_kwargs=None):
        """The model's reply to a conversation ([{"role", "content"}]), rendered by its chat template."""
        return self.generate(chat_prompt(messages, chat_template_kwargs), params)

    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a string, or of a conversation (list of messages) through the chat template."""
        return self._ask(self._tokenize_request(prompt, add_special_tokens)).token_ids

    def token_strings(self, prompt, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        """``tokenize``'s ids and each id's token string as the vocabulary spells it (e.g. "Ġworld")."""
        reply = self._ask(self._tokenize_request(prompt, add_special_tokens, True))
        return reply.token_ids, reply.token_strs

    def detokenize(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self._ask(self._detokenize_request(token_ids, False, skip_special_tokens)).text

    def token_texts(self, token_ids) -> list[str]:
        """Each id's own text (special tokens included)."""
        return self._ask(self._detokenize_request(token_ids, True, False)).token_texts

    def abort(self, request_id: str) -> None:
        """Abort a request (no error if it already finished); the server frees its KV blocks. A stream of that
        request then ends with a delta whose finish_reason is "abort"."""
        self._send(self._control(Abort, request_id))

    def health(self) -> dict:
        """{"healthy": bool, "message": str}"""
        return self._call(Health)

    def info(self) -> dict:
        """What the server serves, how; the client also takes the server's message limit from it."""
        return self._learn(self._call(Info))

    def stats(self) -> dict:
        return self._call(Stats)

    def close(self) -> None:
        self._keepalive_stop.set()
        with self._lock:
            if not self._sock.closed:
                self._watch.close()
                self._sock.close()
                self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream(StreamState):
    """The deltas of one streaming request. Closing it (or dropping it, or leaving a ``for``/``with`` early)
    before the last delta aborts the request on the server. ``completion`` holds the whole result once done."""

    def __init__(self, client: Client, request_id: str) -> None:
        super().__init__(client, request_id, client._inbox)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Delta:
        if self._done:
            raise StopIteration
        try:
            msg = self.client._next(self.request_id)
        except BaseException:
            self.close()
            raise
        return self._take(msg)

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
