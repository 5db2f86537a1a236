"""The soak's traffic (benchmarks/soak.py): one action per call, each returning how it ended.

An action returns ``(kind, latency_s)``. ``kind`` is "ok", an expected refusal or client-side ending
("http 400", "zmq RequestError", "client timeout", "client disconnect", ...), or, prefixed "UNEXPECTED ", something a
healthy server must never do (a 5xx, a dropped connection on a well-formed request, an ok request that failed).
Faults (oversized, malformed, wrong types, huge ints) expect any 4xx; a 5xx or a lost connection is unexpected.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import httpx

from client import AsyncClient, EngineDeadError, OverloadedError, RequestError, SamplingParams
from protocol.codec import ProtocolError

WORDS = ["the", "quick", "brown", "fox", "def", "return", "héllo", "naïve ✓", "import os", "for i in range(", "\n"]
STOPS = [["\n"], ["fox", "the"], ["."], []]


def _text(rng: random.Random, lo: int = 3, hi: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


class Traffic:
    """Shared state of the actions: the HTTP client, the server's model name and vocabulary, one ZMQ client per
    few requests (many connection identities over a soak), and the headers (API key)."""

    def __init__(self, base_url: str, address: str, model: str, vocab: int, api_key: str | None, seed: int) -> None:
        self.base_url, self.address, self.model, self.vocab = base_url.rstrip("/"), address, model, vocab
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=64))
        self.rng = random.Random(seed)
        self._zmq: dict[int, tuple[AsyncClient, int]] = {}  # per traffic slot: its client, and the client's uses

    async def aclose(self) -> None:
        await self.http.aclose()
        for c, _ in self._zmq.values():
            await c.aclose()

    def zmq(self, slot: int) -> AsyncClient:
        """``slot``'s client, replaced every 20 uses: the server sees a stream of new ZMQ identities. One per slot:
        closing a client fails the requests in flight on it."""
        c, uses = self._zmq.get(slot, (None, 0))
        if c is None or uses >= 20:
            if c is not None:
                c.close()
            c, uses = AsyncClient(self.address, token=self.api_key, timeout=120, connect_timeout=30), 0
        self._zmq[slot] = (c, uses + 1)
        return c

    def ids(self, lo: int = 1, hi: int = 60) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(lo, hi))]

    # ---- HTTP ----------------------------------------------------------------------------------------------

    def _body(self, chat: bool, stream: bool) -> dict:
        r = self.rng
        body: dict = {"model": self.model, "max_tokens": r.randint(1, 24), "stream": stream, "temperature": r.random()}
        if chat:
            body["messages"] = [{"role": "user", "content": _text(r)}]
            if r.random() < 0.3:
                body["logprobs"], body["top_logprobs"] = True, r.randint(0, 3)
        else:
            body["prompt"] = _text(r) if r.random() < 0.6 else self.ids()
            if r.random() < 0.3:
                body["logprobs"] = r.randint(0, 3)
        if r.random() < 0.4:
            body["stop"] = r.choice(STOPS)
        if stream and r.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body

    async def http_generate(self, chat: bool, stream: bool) -> tuple[str, float]:
        path = "/chat/completions" if chat else "/completions"
        body, t0 = self._body(chat, stream), time.perf_counter()
        try:
            if not stream:
                resp = await self.http.post(self.base_url + path, json=body, headers=self.headers)
                return _http_kind(resp.status_code, ok=(200,)), time.perf_counter() - t0
            async with self.http.stream("POST", self.base_url + path, json=body, headers=self.headers) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return _http_kind(resp.status_code, ok=()), time.perf_counter() - t0
                done = False
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and '"error"' in line[:40]:
                        return "UNEXPECTED stream error: " + line[6:120], time.perf_counter() - t0
                    done = done or line == "data: [DONE]"
                kind = "ok" if done else "UNEXPECTED stream ended without [DONE]"
                return kind, time.perf_counter() - t0
        except httpx.HTTPError as e:
            return f"UNEXPECTED http {type(e).__name__}", time.perf_counter() - t0

    async def http_disconnect(self) -> tuple[str, float]:
        """A stream closed by the client after a few chunks: the server must abort it and free its blocks."""
        body, t0 = self._body(self.rng.random() < 0.5, True), time.perf_counter()
        body["max_tokens"], body["ignore_eos"] = 200, True
        path = "/chat/completions" if "messages" in body else "/completions"
        try:
            async with self.http.stream("POST", self.base_url + path, json=body, headers=self.headers) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return _http_kind(resp.status_code, ok=()), time.perf_counter() - t0
                n = 0
                async for _ in resp.aiter_lines():
                    n += 1
                    if n >= 6:
                        break
        except httpx.HTTPError as e:
            return f"UNEXPECTED http {type(e).__name__}", time.perf_counter() - t0
        return "client disconnect", time.perf_counter() - t0

    async def http_timeout(self) -> tuple[str, float]:
        """A client that gives up (read timeout) on a long non-streamed request."""
        body, t0 = self._body(False, False), time.perf_counter()
        body["max_tokens"], body["ignore_eos"] = 300, True
        try:
            resp = await self.http.post(self.base_url + "/completions", json=body, headers=self.headers, timeout=0.2)
            return _http_kind(resp.status_code, ok=(200,)), time.perf_counter() - t0
        except httpx.TimeoutException:
            return "client timeout", time.perf_counter() - t0
        except httpx.HTTPError as e:
            return f"UNEXPECTED http {type(e).__name__}", time.perf_counter() - t0

    async def http_tokenize(self) -> tuple[str, float]:
        t0 = time.perf_counter()
        body = {"model": self.model, "prompt": _text(self.rng, 1, 200)}
        if self.rng.random() < 0.5:
            body = {"model": self.model, "messages": [{"role": "user", "content": _text(self.rng)}]}
        try:
            resp = await self.http.post(
                self.base_url.removesuffix("/v1") + "/tokenize", json=body, headers=self.headers
            )
        except httpx.HTTPError as e:
            return f"UNEXPECTED http {type(e).__name__}", time.perf_counter() - t0
        return _http_kind(resp.status_code, ok=(200,)), time.perf_counter() - t0

    async def http_fault(self) -> tuple[str, float]:
        """A request the server must refuse with a 4xx and survive: oversized, malformed, wrong types, huge ints."""
        r, t0 = self.rng, time.perf_counter()
        which = r.choice(["oversized", "malformed", "wrong_type", "huge_max_tokens", "huge_ids", "huge_logit_bias"])
        url, content, body = self.base_url + "/completions", None, {"model": self.model, "prompt": "hi"}
        if which == "oversized":
            content = b'{"model": "%s", "prompt": "' % self.model.encode() + b"x" * (12 << 20) + b'"}'  # > 8 MiB
        elif which == "malformed":
            content = b'{"model": "%s", "prompt": "hi", "max_tokens": 4' % self.model.encode()
        elif which == "wrong_type":
            body["max_tokens"] = r.choice(["four", [4], {"n": 4}, 4.5])
        elif which == "huge_max_tokens":
            body["max_tokens"] = 2**64 + r.randint(0, 1000)
        elif which == "huge_ids":
            body["prompt"] = [1, 2, 2**64 + 5]
        else:
            body["logit_bias"] = {str(2**70): 1.0}
        headers = dict(self.headers, **{"Content-Type": "application/json"})
        try:
            if content is None:
                content = json.dumps(body).encode()
            resp = await self.http.post(url, content=content, headers=headers)
        except httpx.HTTPError as e:
            # a server may close the connection on a body it will not read; anything else is a failure
            kind = "fault connection closed" if which == "oversized" else f"UNEXPECTED http {type(e).__name__}"
            return kind, time.perf_counter() - t0
        code = resp.status_code
        kind = f"fault http {code}" if 400 <= code < 500 else f"UNEXPECTED fault {which} http {code}"
        return kind, time.perf_counter() - t0

    # ---- ZMQ -----------------------------------------------------------------------------------------------

    def _params(self, stream_len: int | None = None) -> SamplingParams:
        r = self.rng
        return SamplingParams(
            temperature=r.random(),
            max_tokens=stream_len or r.randint(1, 24),
            stop=r.choice(STOPS),
            logprobs=r.choice([None, None, 2]),
            ignore_eos=stream_len is not None,
        )

    async def zmq_generate(self, kind: str, slot: int) -> tuple[str, float]:
        c, r, t0 = self.zmq(slot), self.rng, time.perf_counter()
        prompt = _text(r) if r.random() < 0.6 else self.ids()
        try:
            if kind == "generate":
                await c.generate(prompt, self._params())
            elif kind == "chat":
                await c.chat([{"role": "user", "content": _text(r)}], self._params())
            elif kind == "tokenize":
                await c.tokenize(_text(r, 1, 200))
            elif kind == "stream":
                async for _ in c.stream(prompt, self._params()):
                    pass
            elif kind == "leave":  # leave the stream early: the client aborts it
                stream = c.stream(prompt, self._params(200))
                n = 0
                async for _ in stream:
                    n += 1
                    if n >= 4:
                        break
                await stream.aclose()
                return "client disconnect", time.perf_counter() - t0
            elif kind == "timeout":  # a wait that gives up: the client aborts the request
                try:
                    await asyncio.wait_for(c.generate(prompt, self._params(300)), 0.2)
                except (asyncio.TimeoutError, TimeoutError):
                    return "client timeout", time.perf_counter() - t0
            elif kind == "bad":  # a request the engine refuses by field
                await c.generate(prompt, SamplingParams(max_tokens=10**6))
                return "UNEXPECTED bad request accepted", time.perf_counter() - t0
        except RequestError:
            return ("zmq RequestError" if kind == "bad" else "UNEXPECTED zmq RequestError"), time.perf_counter() - t0
        except OverloadedError:
            return "zmq Overloaded", time.perf_counter() - t0
        except (EngineDeadError, ProtocolError, ConnectionError, TimeoutError) as e:
            return f"UNEXPECTED zmq {type(e).__name__}", time.perf_counter() - t0
        return "ok", time.perf_counter() - t0


KILLED_CLIENT = """
import asyncio, sys
from client import AsyncClient, SamplingParams

async def main():
    c = AsyncClient(sys.argv[1], token=sys.argv[2] or None, connect_timeout=30)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    streams = [c.stream("soak " * 20, params) for _ in range(8)]
    await streams[0].__anext__()  # the server has them: they are running
    print("sent", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def killed_client(address: str, api_key: str | None) -> tuple[str, float]:
    """A ZMQ client process that sends 8 long streamed requests and is killed (-9) without aborting them."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_CLIENT, address, api_key or "", stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
    except asyncio.TimeoutError:
        line = b""
    proc.kill()
    await proc.wait()
    kind = "client killed" if line.startswith(b"sent") else "UNEXPECTED killed client never sent"
    return kind, time.perf_counter() - t0


def _http_kind(code: int, ok: tuple[int, ...]) -> str:
    if code in ok or (not ok and code == 200):
        return "ok"
    if code == 429:
        return "http 429"
    return f"UNEXPECTED http {code}" if code >= 500 or code < 400 else f"UNEXPECTED http {code} on a good request"
