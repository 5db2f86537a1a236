"""benchmarks/http_client.py, the load generator's HTTP client, against real sockets: a chunked stream read line by
line as it arrives, a Content-Length body, keep-alive reuse of one connection, and a connection that breaks inside
a body (an HTTPError, and the connection is not reused)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.http_client import HttpClient, HTTPError
from tests.support.timeouts import HANG_S


class Server:
    """An asyncio HTTP/1.1 server: /sse answers two events (chunked), /json a Content-Length body, /cut a chunked
    body that stops mid-chunk and closes. Counts the connections it accepted."""

    def __init__(self) -> None:
        self.connections = 0
        self.bodies: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
                )
                self.bodies.append(await reader.readexactly(length))
                path = head.split(b" ")[1]
                if path == b"/api/sse":
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    for event in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\ndata: [DONE]\n\n'):
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                elif path == b"/api/json":
                    writer.write(b'HTTP/1.1 404 Not Found\r\ncontent-length: 11\r\n\r\n{"a": "b"}\n')
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n20\r\nonly part")
                    await writer.drain()
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def scenario() -> tuple[list, Server]:
    srv = Server()
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    got = []
    async with server, HttpClient(f"http://127.0.0.1:{port}/api", {"Authorization": "Bearer k"}) as client:
        for _ in range(2):
            async with client.stream("POST", "/sse", {"prompt": [1, 2]}) as resp:
                got.append((resp.status, [line async for line in resp.lines()]))
        got.append(await client.request("GET", "/json"))
        with pytest.raises(HTTPError):
            await client.request("GET", "/cut")
        got.append(await client.request("GET", "/json"))
    return got, srv


def test_streams_lines_reuses_the_connection_and_fails_a_cut_body():
    got, srv = asyncio.run(asyncio.wait_for(scenario(), HANG_S))
    events = [b'data: {"n": 1}', b"", b'data: {"n": 2}', b"", b"data: [DONE]", b""]
    assert got[0] == (200, events) and got[1] == (200, events)
    assert got[2] == (404, b'{"a": "b"}\n')
    assert got[3] == (404, b'{"a": "b"}\n')
    assert srv.bodies[0] == b'{"prompt":[1,2]}' and srv.bodies[2] == b""
    # one keep-alive connection for the first three requests; the cut one is dropped, so the last opens another
    assert srv.connections == 2
