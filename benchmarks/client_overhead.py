"""What does the load generator's HTTP client add to a TTFT? Each client streams the same completion request from a
trivial server (another process: asyncio, answering every POST at once with one server-sent event and [DONE], as a
chunked response on a keep-alive connection), sequentially; the time to the first event is the client's own cost
plus a loopback round trip, which a blocking raw socket (the floor) measures alone.

    python -m benchmarks.client_overhead [--requests 400] [--rounds 3] [--clients raw lean httpx aiohttp]

Prints p50 and mean per client and each one's p50 over the floor; the last line is JSON. httpx and aiohttp are
measured when installed. No model, no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time

BODY = {"model": "m", "prompt": list(range(128)), "max_tokens": 16, "stream": True}
EVENT = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
WARMUP = 20


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
            )
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def serve(port: int) -> None:
    server = await asyncio.start_server(_handle, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def raw_firsts(port: int, n: int) -> list[float]:
    data = json.dumps(BODY).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(data), data)
    )
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            start, buf, first = time.perf_counter(), b"", None
            s.sendall(request)
            while not buf.endswith(b"0\r\n\r\n"):
                buf += s.recv(65536)
                if first is None and b"data: {" in buf:
                    first = time.perf_counter() - start
            out.append(first)
    return out


async def lean_firsts(port: int, n: int) -> list[float]:
    from benchmarks.http_client import HttpClient

    out = []
    async with HttpClient(f"http://127.0.0.1:{port}") as client:
        for _ in range(n):
            start, first = time.perf_counter(), None
            async with client.stream("POST", "/v1/completions", BODY) as resp:
                async for line in resp.lines():
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - start
            out.append(first)
    return out


async def httpx_firsts(port: int, n: int) -> list[float]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(n):
            start, first = time.perf_counter(), None
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=BODY) as resp:
                async for line in resp.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - start
            out.append(first)
    return out


async def aiohttp_firsts(port: int, n: int) -> list[float]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            start, first = time.perf_counter(), None
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY) as resp:
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - start
            out.append(first)
    return out


CLIENTS = {
    "raw": lambda port, n: raw_firsts(port, n),
    "lean": lambda port, n: asyncio.run(lean_firsts(port, n)),
    "httpx": lambda port, n: asyncio.run(httpx_firsts(port, n)),
    "aiohttp": lambda port, n: asyncio.run(aiohttp_firsts(port, n)),
}


def _installed(name: str) -> bool:
    if name in ("raw", "lean"):
        return True
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--requests", type=int, default=400, help="sequential requests per client and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every client, alternating")
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS), help="the clients timed")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the trivial server's process
    a = p.parse_args(argv)
    if a.serve is not None:
        asyncio.run(serve(a.serve))
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.client_overhead", "--serve", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        server.stdout.readline()  # "ready"
        names = [c for c in a.clients if _installed(c)]
        times: dict[str, list[float]] = {c: [] for c in names}
        for _ in range(a.rounds):
            for c in names:
                times[c] += CLIENTS[c](port, a.requests)[WARMUP:]
    finally:
        server.terminate()
        server.wait()
    res = {f"{c}_p50_ms": round(statistics.median(v) * 1e3, 4) for c, v in times.items()}
    res |= {f"{c}_mean_ms": round(statistics.mean(v) * 1e3, 4) for c, v in times.items()}
    floor = res.get("raw_p50_ms", 0.0)
    for c in times:
        print(f"{c:8s} first event p50 {res[c + '_p50_ms']:.3f} ms (+{res[c + '_p50_ms'] - floor:.3f} over raw), "
              f"mean {res[c + '_mean_ms']:.3f} ms")  # fmt: skip
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
