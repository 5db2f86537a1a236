"""Running a request's choices on the coordinator: all at once (non-streaming) or as one merged stream of
deltas, and sending that stream as server-sent events (one event per delta) that end, and abort the request,
when the HTTP client goes away. A choice the server aborts while its client is still there (a shutdown) fails the
request: an error status, or an error event before [DONE], never a success with finish_reason "abort"."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from client.async_client import AsyncStream
from openai_server.engine_client import EngineClient
from openai_server.errors import AbortedByServer
from protocol.client_messages import Delta
from protocol.outputs import Completion

DONE = b"data: [DONE]\n\n"
HEADERS_WAIT_S = 2.0  # how long a streaming response waits for its first delta before it starts anyway


def usage_events(stream_options) -> tuple[bool, bool]:
    """(a last event with the usage, the usage in every event too): ``stream_options``' include_usage and vLLM's
    continuous_usage_stats, which counts only with include_usage, as vLLM's."""
    if stream_options is None or not stream_options.include_usage:
        return False, False
    return True, stream_options.continuous_usage_stats


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # json.dumps' own, made once: not per event


def _json(payload) -> str:
    text = _ENCODER.encode(payload)
    if not text.isascii():  # JSON may carry these line breaks raw, but a client that splits the stream with
        # str.splitlines (httpx's iter_lines) would cut the event at them
        text = text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return text


def sse(payload: dict) -> bytes:
    return b"data: " + _json(payload).encode() + b"\n\n"


class TextEvents:
    """A stream's common event, one choice's new text and nothing else (no logprobs, not its last, no usage), as
    the very bytes ``sse`` makes of its dict, from the parts of it built once per request: per token, no dict is
    built and only the text is encoded (measured: 1.3 against 4.7 us an event). ``chat``: the text goes in the
    choice's ``delta`` as its content, else in its ``text``."""

    __slots__ = ("_start", "_field", "_end")

    def __init__(self, head: dict, chat: bool) -> None:
        self._start = "data: " + _json(head)[:-1] + ',"choices":[{"index":'  # {**head, "choices": ...}
        self._field = ',"delta":{"content":' if chat else ',"text":'
        self._end = ("}" if chat else "") + ',"logprobs":null,"finish_reason":null}]}\n\n'

    def event(self, index: int, text: str) -> bytes:
        return (self._start + str(index) + self._field + _json(text) + self._end).encode()


async def _all_or_none(coros) -> list:
    """Run the awaitables together; the first failure cancels the others (a cancelled generate is aborted on
    the coordinator) and is raised. Awaited through ``asyncio.wait``, not ``gather``: the loop turn that wakes the
    caller then holds a bare waiter, not a future holding the failure, whose traceback would keep the request's
    frames (a body's prompt of megabytes) alive past the body limit's reclaim."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


async def generate_all(engine: EngineClient, jobs: list[tuple]) -> list[Completion]:
    """Every (prompt, params) job at once, results in order."""
    if len(jobs) == 1:  # the common case: in this task, no task or gather of its own
        return [await _unaborted(engine.generate(*jobs[0]))]
    return await _all_or_none(_unaborted(engine.generate(p, sp)) for p, sp in jobs)


_ABORTED = "the server stopped it before it finished (shutting down)"


async def _unaborted(generation) -> Completion:
    c = await generation
    if c.finish_reason == "abort":  # our client's aborts cancel the handler first: this one is the server's
        raise AbortedByServer(_ABORTED)
    return c


def _checked(d: Delta) -> Delta:
    if d.finish_reason == "abort":
        raise AbortedByServer(_ABORTED)
    return d


class ChoiceStreams:
    """The streams of a request's choices (choice i = jobs[i]), merged into one iterator of (index, Delta)."""

    def __init__(self, engine: EngineClient, jobs: list[tuple]) -> None:
        self.streams: list[AsyncStream] = []
        try:
            for p, sp in jobs:
                self.streams.append(engine.stream(p, sp))
        except BaseException:
            self.close()
            raise
        self.firsts: list[Delta] = []
        self._first: asyncio.Future | None = None

    async def start(self, wait_s: float = HEADERS_WAIT_S) -> None:
        """Wait up to ``wait_s`` for every choice's first delta, so that a request the coordinator rejects fails
        with its status before the response starts; a request still queued after that starts its response (the
        deltas follow), so a client's header timeout never fires while it waits in line."""
        if len(self.streams) == 1:  # the common case, awaited in this task: no task, no gather per request
            try:
                first = await self.streams[0].next_within(wait_s)
                self.firsts = [] if first is None else [_checked(first)]
            except BaseException:
                self.close()
                raise
            return
        self._first = asyncio.ensure_future(_all_or_none(anext(s) for s in self.streams))
        try:
            await asyncio.wait((self._first,), timeout=wait_s)
        except BaseException:  # cancelled (the client left)
            self._first.cancel()
            self.close()
            raise
        if self._first.done():
            try:
                self.firsts = [_checked(d) for d in self._first.result()]  # aborted already: an error status
            except BaseException:
                self.close()
                raise

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        try:
            if not self.firsts:
                self.firsts = await self._first if self._first is not None else [await anext(self.streams[0])]
            for i, d in enumerate(self.firsts):
                yield i, _checked(d)
            live = [i for i, d in enumerate(self.firsts) if d.finish_reason is None]
            if len(live) == 1:
                i = live[0]
                async for d in self.streams[i]:
                    yield i, _checked(d)
            elif live:
                async for item in self._merged(live):
                    yield item
        finally:
            if self._first is not None and not self._first.done():
                self._first.cancel()
            self.close()

    async def _merged(self, live: list[int]) -> AsyncIterator[tuple[int, Delta]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for d in self.streams[i]:
                    queue.put_nowait((i, d))
            except Exception as e:  # the request failed (e.g. the engine died): the whole response ends with it
                queue.put_nowait((i, e))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in live]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, _checked(item)
        finally:
            for t in tasks:
                t.cancel()

    def close(self) -> None:
        """Abort every choice still running (nothing for those that finished)."""
        for s in self.streams:
            s._close()


class CancelOnDisconnect:
    """``async with``: the block runs in the current task, which is cancelled if the HTTP client disconnects (the
    ASGI ``http.disconnect`` message) meanwhile; that cancel is then taken back and the block's exception
    swallowed (``left`` says so). A watcher task waits for the message: the work itself needs no task of its own,
    nor a loop turn to start."""

    def __init__(self, receive) -> None:
        self.receive, self.left, self._running = receive, False, True

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if self._running:
            self.left = True
            self._task.cancel()

    async def __aenter__(self) -> CancelOnDisconnect:
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, *exc) -> bool:
        self._running = False
        self._watcher.cancel()
        if self.left:
            self._task.uncancel()  # our own cancel: the request ends here, quietly
        return self.left


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects: the body iterator is cancelled, which
    aborts the request on the coordinator (its KV blocks are freed)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async with CancelOnDisconnect(receive):
            try:
                await self.stream_response(send)
            except OSError:  # the connection broke while writing
                pass
