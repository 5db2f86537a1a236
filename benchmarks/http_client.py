"""A lean HTTP/1.1 client on asyncio streams, for the load generator (benchmarks/serve.py): keep-alive connections,
Content-Length and chunked bodies, server-sent events line by line; plain http only, no redirects, no cookies.

Why not httpx or aiohttp: a benchmark's client time is counted in every TTFT it reports. On the H200 host httpx
added ~2.1 ms to a first event against a raw socket and aiohttp ~0.5 ms (docs/PERFORMANCE_LOG.md log 20b);
benchmarks/client_overhead.py measures all of them against a trivial server, so the figure stays checked.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class HTTPError(Exception):
    """The connection broke, or the server's answer is not HTTP/1.1 as this client reads it."""


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]
    # how the body is framed and where it is read; the client sets them from the head and reads them on release
    conn: Connection | None = field(default=None, repr=False)
    chunked: bool = False
    left: int | None = None  # Content-Length still unread (None: chunked or until the connection closes)
    done: bool = False  # the body was read to its end
    reusable: bool = True  # the connection may carry another request once the body is done

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunk by chunk, as the server sent it)."""
        reader = self.conn.reader
        try:
            if self.chunked:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the empty line
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self.left is not None:
                while self.left:
                    data = await reader.read(min(self.left, 1 << 16))
                    if not data:
                        raise HTTPError("the connection closed inside the body")
                    self.left -= len(data)
                    yield data
            else:  # no length given: the body ends with the connection
                self.reusable = False
                while data := await reader.read(1 << 16):
                    yield data
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError) as e:
            self.reusable = False
            raise HTTPError(f"reading the body: {type(e).__name__}: {e}") from None
        self.done = True

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines (without their line ends), each as soon as its end arrives: server-sent events."""
        tail = b""
        async for data in self.chunks():
            parts = (tail + data).split(b"\n")
            tail = parts.pop()
            for line in parts:
                yield line.rstrip(b"\r")
        if tail:
            yield tail

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def json(self):
        return json.loads(await self.read())


@dataclass(slots=True)
class Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class HttpClient:
    """Requests to one server (``base_url``'s host and port; paths are appended to its path). Any number of
    requests may run at once: each takes an idle keep-alive connection or opens one."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, got {base_url!r}")
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/")
        host_header = f"[{self.host}]" if ":" in self.host else self.host
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {host_header}:{self.port}\r\n{extra}"
        self._idle: list[Connection] = []

    async def _connect(self) -> Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(reader, writer)

    def _release(self, resp: Response) -> None:
        conn, resp.conn = resp.conn, None
        if conn is None:
            return
        if resp.done and resp.reusable:
            self._idle.append(conn)
        else:
            conn.writer.close()

    @asynccontextmanager
    async def stream(self, method: str, path: str, body=None) -> AsyncIterator[Response]:
        """Send a request (``body``: a JSON-able value or None) and hand back its response once the status line
        and headers are in; the body is read from it (``lines``, ``chunks``, ``read``)."""
        data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(data)}\r\n"
        if body is not None:
            head += "Content-Type: application/json\r\n"
        conn = await self._connect()
        try:
            conn.writer.write(head.encode() + b"\r\n" + data)
            resp = await _read_head(conn)
        except BaseException:
            conn.writer.close()
            raise
        try:
            yield resp
        finally:
            self._release(resp)

    async def request(self, method: str, path: str, body=None) -> tuple[int, bytes]:
        """(status, whole body)."""
        async with self.stream(method, path, body) as resp:
            return resp.status, await resp.read()

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.writer.close()
        self._idle.clear()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def _read_head(conn: Connection) -> Response:
    try:
        raw = await conn.reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError) as e:
        raise HTTPError(f"no response: {type(e).__name__}: {e}") from None
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HTTPError(f"not an HTTP/1.1 status line: {lines[0][:100]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    resp = Response(int(parts[1]), headers, conn)
    resp.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    if not resp.chunked and headers.get("content-length", "").isdigit():
        resp.left = int(headers["content-length"])
    resp.reusable = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
    return resp
