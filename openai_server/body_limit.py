"""A cap on HTTP request bodies (ASGI middleware), so that one client cannot make the front-end buffer and parse
a body larger than any request the coordinator takes: past ``max_bytes`` (the coordinator's --max-message-bytes by
default) the request gets a 413 in OpenAI's error shape and its connection is closed. A declared Content-Length
over the cap is refused before any of the body is read; a chunked body is counted as it arrives and refused at the
chunk that crosses the cap. Either way the app never sees, let alone parses, a body over the cap."""

from __future__ import annotations

import ctypes
import gc

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_server.errors import APIError

LARGE_BODY_BYTES = 1 << 20  # after a body this large the front-end gives its parsed copies' memory back (reclaim)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _libc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # glibc
    except OSError:
        return None


_LIBC = _libc()


def keep_large_buffers_mapped() -> None:
    """Allocate every buffer of 1 MiB or more (a body, its joined copy, a long id list) as its own mapping, given
    back when freed. glibc's default raises its mmap threshold to the largest block freed (up to 32 MiB), after
    which such buffers come from the heap and stay with the process: measured, +24 MiB after two 8 MiB bodies."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, LARGE_BODY_BYTES)


def reclaim() -> None:
    """Free what a large request left in reference cycles (an exception's traceback holding the handler's frames,
    asyncio tasks: the body, its parsed JSON, a million-id prompt), which else waits for a full collection that
    plain ints never trigger, and hand the freed heap back to the OS."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is over the server's limit of {max_bytes} bytes")


async def refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer ``error`` and close the connection: the rest of the body is never read (nor drained)."""
    response = error.response()
    response.headers["connection"] = "close"
    await response(scope, receive, send)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes
        keep_large_buffers_mapped()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await refuse(too_large(self.max_bytes), scope, receive, send)
            return
        if not length and "chunked" not in headers.get("transfer-encoding", "").lower():
            await self.app(scope, receive, send)  # no body
            return
        # read the whole body here, counting, so that an oversized one is refused before the app starts on it
        body, seen = await self._read(receive)
        try:
            if body is None:
                await refuse(too_large(self.max_bytes), scope, receive, send)
                return
            first: Message | None = body
            del body

            async def replay() -> Message:
                nonlocal first
                if first is None:
                    return await receive()  # after the body: http.disconnect, which until_disconnect waits for
                message, first = first, None  # the app holds the body from here on, not this closure
                return message

            await self.app(scope, replay, send)
        finally:
            if seen > LARGE_BODY_BYTES:
                reclaim()

    async def _read(self, receive: Receive) -> tuple[Message | None, int]:
        """The body as one message (or the client's disconnect, which the app then sees first), None past the
        limit; and the bytes read."""
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message, seen
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return None, seen
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}, seen
