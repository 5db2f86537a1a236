"""One streaming request's deltas as an async iterator, read from the queue the AsyncClient's reader fills."""

from __future__ import annotations

import asyncio

from client.base import _Base
from client.replies import StreamState
from protocol.client_messages import Delta


class AsyncStream(StreamState):
    """Async iterator over one streaming request's deltas; leaving early (``aclose()``, ``async with``,
    cancellation, garbage collection) aborts the request."""

    def __init__(self, client: _Base, request_id: str, queue: asyncio.Queue) -> None:  # an AsyncClient
        super().__init__(client, request_id, client._queues)
        self._queue = queue

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            msg = await self.client._next(self.request_id, self._queue)
        except BaseException:
            self._close()
            raise
        return self._take(msg)

    async def next_within(self, wait_s: float) -> Delta | None:
        """The next delta, or None when none came within ``wait_s`` (nothing is lost: the stream goes on). It
        waits in the caller's task, with no task of its own between the reply and the caller."""
        if self._done:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout(wait_s):
                msg = await self._queue.get()  # a get cancelled by the timeout leaves the queue as it was
        except TimeoutError:
            return None
        except BaseException:
            self._close()
            raise
        if isinstance(msg, BaseException):
            self._close()
            raise msg
        return self._take(msg)

    async def aclose(self) -> None:
        self._close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self._close()
