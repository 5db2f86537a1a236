"""The HTTP front-end's own Python time, without sockets or an engine: the real app (openai_server.app.build_app:
its middleware, routes, parsing, streaming) driven in-process through ASGI by streamed /v1/completions requests of
128 token ids, against a stand-in engine whose stream gives ``--tokens`` deltas at once. Hot caches, one process:
a figure a loaded box barely moves, for A/B of the front-end's request path (time per request, and per token from
the difference of two stream lengths). CPU; prints one line per length, the last line JSON.

    python -m benchmarks.frontend_cpu [--requests 2000] [--rounds 5] [--tokens 2 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from openai_server.app import build_app
from openai_server.metrics import Metrics
from openai_server.state import ServerState
from protocol.client_messages import Delta


class _Stream:
    """A streamed request's deltas, ``count`` of them, the first after one loop turn (as a reply would come)."""

    def __init__(self, count: int) -> None:
        self.count, self.n = count, 0

    def _step(self) -> Delta:
        self.n += 1
        if self.n > self.count:
            raise StopAsyncIteration
        if self.n == self.count:
            return Delta("r", [6], "!", "length", prompt_token_ids=[1], num_prompt_tokens=128)
        return Delta("r", [5], " tok", None, num_prompt_tokens=128)

    async def next_within(self, wait_s: float) -> Delta:
        await asyncio.sleep(0)
        return self._step()

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Delta:
        if self.n == 0:
            await asyncio.sleep(0)
        return self._step()

    def _close(self) -> None:
        pass


class _Engine:
    served_model_names, served_model_name, generation_defaults = ["m"], "m", {}
    info, max_model_len = {"model": "m"}, 4096

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def stream(self, prompt, params) -> _Stream:
        return _Stream(self.tokens)


async def _requests(app, body: bytes, n: int) -> None:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}  # fmt: skip
    never = asyncio.Event()
    for _ in range(n):
        await _one(app, scope, body, never)


async def _one(app, scope: dict, body: bytes, never: asyncio.Event) -> None:
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    status = []

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await never.wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(dict(scope), receive, send)
    if status != [200]:
        raise RuntimeError(f"the request failed: {status}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--requests", type=int, default=2000, help="streamed requests a round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per stream length (the median is shown)")
    p.add_argument("--tokens", type=int, nargs="+", default=[2, 200], help="deltas per stream (lengths timed)")
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompt = [rng.randint(10, 8000) for _ in range(128)]
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}).encode()
    res: dict = {}

    async def run() -> None:
        for tokens in a.tokens:
            app = build_app(ServerState(_Engine(tokens), Metrics("m")), 1 << 24)
            await _requests(app, body, 100)  # warm
            times = []
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                await _requests(app, body, a.requests)
                times.append((time.perf_counter() - t0) / a.requests * 1e6)
            res[f"us_per_request_{tokens}_tokens"] = round(statistics.median(times), 1)
            print(f"{tokens:5d} deltas: {statistics.median(times):8.1f} us a request (median of {a.rounds} rounds)")

    try:
        import uvloop  # the front-end's loop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())
    if len(a.tokens) >= 2:
        lo, hi = min(a.tokens), max(a.tokens)
        per = (res[f"us_per_request_{hi}_tokens"] - res[f"us_per_request_{lo}_tokens"]) / (hi - lo)
        res["us_per_token"] = round(per, 2)
        print(f"per token: {per:.2f} us")
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
