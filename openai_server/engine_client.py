"""The front-end's view of the coordinator: one AsyncClient (one ZMQ socket for every HTTP request), the
coordinator's Info, and the token texts that logprobs name (fetched once per id, then cached).

The coordinator limits pending requests per (ZMQ identity, ``Generate.client``). The front-end is one ZMQ identity
for every HTTP user, so each request's Generate carries the HTTP peer's address as its ``client``: nanoserve has
one shared --api-key, which tells no two users apart, while the address does (behind a reverse proxy every user
shares the proxy's address, and so its limit)."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar

from starlette.requests import HTTPConnection

from client.async_client import AsyncClient, AsyncStream
from protocol.outputs import Completion

CONTROL_TIMEOUT_S = 10.0  # health, stats, info, tokenize: the coordinator answers these between steps
# the HTTP user a request's Generates are counted for; set per request, inherited by the tasks it starts
CLIENT_LABEL: ContextVar[str] = ContextVar("nanoserve_http_client", default="")


def label_requests(conn: HTTPConnection) -> None:
    """Count the Generates the current request sends against its peer's address."""
    CLIENT_LABEL.set(conn.client.host if conn.client else "")


class EngineClient:
    def __init__(self, address: str, token: str | None, served_model_names: list[str] | None = None) -> None:
        self.client = AsyncClient(address, token=token)  # no timeout: a long generation must not be cut
        self.address = address
        self.info: dict = {}
        self.served_model_names = list(served_model_names or ())  # requests may name any; responses say the first
        self._token_texts: dict[int, str] = {}

    async def connect(self, timeout: float) -> dict:
        """Wait for the coordinator's Info (it answers once its workers are up); the client learns the coordinator's
        message limit from it."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                self.info = await asyncio.wait_for(
                    self.client.info(), max(0.1, deadline - asyncio.get_running_loop().time())
                )
                break
            except ConnectionError:  # not listening yet
                if asyncio.get_running_loop().time() >= deadline:
                    raise
        self.served_model_names = self.served_model_names or [self.info["model"]]
        return self.info

    @property
    def served_model_name(self) -> str:
        """The name responses and metrics carry (vLLM's: the first served name)."""
        return self.served_model_names[0] if self.served_model_names else ""

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    @property
    def max_message_bytes(self) -> int:
        """The coordinator's message limit, learned from its Info: the client refuses larger requests."""
        return self.client.max_message_bytes

    @property
    def generation_defaults(self) -> dict:
        return self.info.get("generation_defaults") or {}

    async def generate(self, prompt, params) -> Completion:
        """One generation, counted for the current HTTP request's peer (label_requests)."""
        return await self.client.generate(prompt, params, client=CLIENT_LABEL.get())

    def stream(self, prompt, params) -> AsyncStream:
        """One streamed generation, counted for the current HTTP request's peer (label_requests)."""
        return self.client.stream(prompt, params, client=CLIENT_LABEL.get())

    async def control(self, coro):
        """A control call (health, stats, tokenize...) bounded in time: a dead coordinator gives TimeoutError."""
        return await asyncio.wait_for(coro, CONTROL_TIMEOUT_S)

    async def token_texts(self, ids) -> list[str]:
        """Each id's own text, for logprobs; one request to the coordinator for the ids not seen before."""
        cache = self._token_texts
        missing = [t for t in dict.fromkeys(ids) if t not in cache]
        if missing:
            for t, text in zip(missing, await self.control(self.client.token_texts(missing))):
                cache[t] = text
        return [cache[t] for t in ids]

    async def close(self) -> None:
        await self.client.aclose()
