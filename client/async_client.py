"""asyncio client for a running nanoserve server: a reader on the socket's descriptor dispatches replies to
per-request queues, so any number of requests (from any number of tasks) can be in flight, and a keep-alive task
tells the server the client is alive while they are. See client/client.py for the protocol.

The socket is a plain ZMQ socket watched by the event loop (``add_reader``), not pyzmq's asyncio socket: a reply
then reaches its waiter in one loop turn, without a receive future and a receiver task between them (measured on
the CPU box: a request's round trip -85..150 us p50 under uvloop, the front-end's loop). Sends never wait (no
high-water mark), so they need no future either."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import zmq

from client.async_stream import AsyncStream
from client.base import DEFAULT_ADDRESS, _as_dict, _Base, chat_prompt
from client.liveness import DEFAULT_CONNECT_TIMEOUT_S, KEEPALIVE_S, ConnectionWatch
from client.local_link import LocalLink
from client.replies import Accumulator, decode_reply, raise_error
from protocol.client_messages import Abort, Error, Health, Info, Stats
from protocol.outputs import Completion
from protocol.sampling_params import SamplingParams

__all__ = ["AsyncClient", "AsyncStream"]


class AsyncClient(_Base):
    """asyncio client: a reader on the socket dispatches replies to per-request queues, so any number of
    requests (from any number of tasks) can be in flight. Cancelling a task that awaits a request aborts it.
    ``timeout``, ``connect_timeout`` and ``max_message_bytes`` work as in ``Client``."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        token: str | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
        max_message_bytes: int | None = None,
    ):
        super().__init__(zmq.Context(), address, token, timeout, connect_timeout, max_message_bytes)
        self._queues: dict[str, asyncio.Queue] = {}
        self._fd = self._sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop whose reader watches the socket
        self._unsent: deque[bytes] = deque()  # frames ZMQ did not take at once (no connection pipe yet)
        self._watcher: asyncio.Task | None = None
        self._keepalive: asyncio.Task | None = None

    @staticmethod
    def _socket(ctx, address: str, connect_timeout: float | None):
        if address.startswith("unix:"):  # the coordinator's local socket (client/local_link.py)
            link = LocalLink(address)
            return link, ConnectionWatch(link, address, None)  # no monitor: the link sees the server's end itself
        return _Base._socket(ctx, address, connect_timeout)

    # ---- plumbing --------------------------------------------------------------------------------------------

    def _ensure_receiver(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._remove_reader()
            loop.add_reader(self._fd, self._on_readable)
            self._loop = loop
        if self._keepalive is None or self._keepalive.done():
            self._keepalive = asyncio.get_running_loop().create_task(self._keepalive_loop())
        if self._watch.monitor is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        """Follow the connection; while no server has been connected for too long, fail every waiter."""
        while True:
            self._watch.drain()
            err = self._watch.error()
            if err is not None:
                for q in self._queues.values():
                    if q.empty():
                        q.put_nowait(err)
            await asyncio.sleep(0.5)

    async def _keepalive_loop(self) -> None:
        """A KeepAlive every second while requests are in flight, read or not (the server aborts the requests of a
        client silent for its heartbeat timeout)."""
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            if self._queues and not self._sock.closed:
                data = self._keepalive_frame()
                if data is not None:
                    self._send_now(data)

    def _on_readable(self) -> None:
        """Every reply waiting, each to its request's queue: ZMQ's descriptor signals edges, so it is drained."""
        sock = self._sock
        try:
            while not sock.closed and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                msg, rid = decode_reply(sock.recv(zmq.NOBLOCK))
                q = self._queues.get(rid)
                if q is not None:
                    q.put_nowait(msg)
        except zmq.Again:
            pass
        except Exception as e:  # the socket broke: fail every waiter rather than leave it hanging
            self.fail_all(e)

    def _remove_reader(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._fd)
            except (RuntimeError, ValueError, OSError):  # the loop or the descriptor is gone already
                pass
        self._loop = None

    def fail_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (e.g. the caller knows the server is gone)."""
        for q in self._queues.values():
            q.put_nowait(error)

    def _send_now(self, data: bytes) -> None:
        """Send without awaiting (ordered with other sends; usable from sync code running in the loop)."""
        self._unsent.append(data)
        self._flush()
        self._last_sent = time.monotonic()

    def _flush(self) -> None:
        sock = self._sock
        try:
            while self._unsent and not sock.closed:
                sock.send(self._unsent[0], zmq.NOBLOCK)
                self._unsent.popleft()
        except zmq.Again:  # no pipe to the server yet: try again shortly
            self._later(0.001, self._flush)
        except zmq.ZMQError as e:
            self._unsent.clear()
            self.fail_all(e)
        self._later(0, self._on_readable)  # a send may have taken the descriptor's edge: look for replies now

    def _later(self, delay: float, fn) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_later(delay, fn) if delay else loop.call_soon(fn)
            except RuntimeError:  # the loop is closing
                pass

    def _open(self, msg) -> tuple[str, asyncio.Queue]:
        data = self._encode(msg)  # a refused message leaves no queue behind
        self._ensure_receiver()
        q = self._queues[msg.request_id] = asyncio.Queue()
        self._send_now(data)
        return msg.request_id, q

    async def _next(self, rid: str, q: asyncio.Queue):
        try:
            if self.timeout is None:
                msg = await q.get()
            else:
                msg = await asyncio.wait_for(q.get(), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply from {self.address} within {self.timeout} s (request {rid})") from None
        if isinstance(msg, BaseException):
            raise msg
        return msg

    def _abort_quietly(self, rid: str) -> None:
        if self._queues.pop(rid, None) is not None and not self._sock.closed:
            try:
                self._send_now(self._encode(self._control(Abort, rid)))
            except Exception:
                pass

    async def _call(self, cls) -> dict:
        return _as_dict(await self._ask(self._control(cls, self._new_id())))

    async def _ask(self, msg):
        rid, q = self._open(msg)
        try:
            reply = await self._next(rid, q)
        finally:
            self._queues.pop(rid, None)
        if isinstance(reply, Error):
            raise_error(reply)
        return reply

    # ---- API -------------------------------------------------------------------------------------------------

    async def generate(self, prompt, params: SamplingParams | None = None, client: str = "") -> Completion:
        """As ``Client.generate`` (``client``: whom the request is for, for the per-client pending limit)."""
        rid, q = self._open(self._labelled_request(prompt, params, False, client))
        try:
            reply = await self._next(rid, q)
        except BaseException:  # CancelledError included: the request must not run on without a reader
            self._abort_quietly(rid)
            raise
        self._queues.pop(rid, None)
        if isinstance(reply, Error):
            raise_error(reply)
        return Accumulator(rid).add(reply)

    async def generate_many(self, prompts: list, params=None, client: str = "") -> list[Completion]:
        """Completions in input order; every request is sent at once."""
        msgs, opened, out = self._generate_requests(prompts, params, client), [], []
        try:
            for m in msgs:  # one refused (e.g. too large) aborts those already sent
                opened.append(self._open(m))
            for rid, q in opened:
                reply = await self._next(rid, q)
                self._queues.pop(rid, None)
                if isinstance(reply, Error):
                    raise_error(reply)
                out.append(Accumulator(rid).add(reply))
        except BaseException:
            for rid, _ in opened:
                self._abort_quietly(rid)
            raise
        return out

    def stream(self, prompt, params: SamplingParams | None = None, client: str = "") -> AsyncStream:
        """Send the request now (call from a running event loop); ``async for`` over the result. ``prompt`` may
        be a ``chat_prompt(messages)``."""
        rid, q = self._open(self._labelled_request(prompt, params, True, client))
        return AsyncStream(self, rid, q)

    async def chat(self, messages: list[dict], params: SamplingParams | None = None, chat_template_kwargs=None):
        """As ``Client.chat``."""
        return await self.generate(chat_prompt(messages, chat_template_kwargs), params)

    async def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        return (await self._ask(self._tokenize_request(prompt, add_special_tokens))).token_ids

    async def token_strings(self, prompt, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        """``tokenize``'s ids and each id's token string as the vocabulary spells it (e.g. "Ġworld")."""
        reply = await self._ask(self._tokenize_request(prompt, add_special_tokens, True))
        return reply.token_ids, reply.token_strs

    async def detokenize(self, token_ids, skip_special_tokens: bool = True) -> str:
        return (await self._ask(self._detokenize_request(token_ids, False, skip_special_tokens))).text

    async def token_texts(self, token_ids) -> list[str]:
        return (await self._ask(self._detokenize_request(token_ids, True, False))).token_texts

    async def abort(self, request_id: str) -> None:
        """As ``Client.abort``."""
        self._ensure_receiver()
        self._send_now(self._encode(self._control(Abort, request_id)))

    async def health(self) -> dict:
        return await self._call(Health)

    async def info(self) -> dict:
        """As ``Client.info`` (the client takes the server's message limit from it)."""
        return self._learn(await self._call(Info))

    async def stats(self) -> dict:
        return await self._call(Stats)

    def close(self) -> None:
        for task in (self._watcher, self._keepalive):
            if task is not None and not task.done():
                task.cancel()
        self._remove_reader()
        if not self._sock.closed:
            self._watch.close()
            self._sock.close()
            self._ctx.term()

    async def aclose(self) -> None:
        for task in (self._watcher, self._keepalive):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __enter__(self) -> AsyncClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
