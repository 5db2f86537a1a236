"""The server's table of requests in flight: which client (ZMQ identity) and client request id each engine request
answers to. Client ids are scoped to a connection; the engine's ids are the server's own."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class ClientRequest:
    identity: bytes  # the client's connection
    request_id: str  # the client's id for it
    engine_id: str  # the engine's id for it


class RequestTable:
    def __init__(self) -> None:
        self._by_engine_id: dict[str, ClientRequest] = {}
        self._by_client: dict[tuple[bytes, str], ClientRequest] = {}
        self._ids = itertools.count()

    def new_engine_id(self) -> str:
        return str(next(self._ids))

    def add(self, identity: bytes, request_id: str, engine_id: str) -> None:
        req = ClientRequest(identity, request_id, engine_id)
        self._by_engine_id[engine_id] = req
        self._by_client[(identity, request_id)] = req

    def get(self, engine_id: str) -> ClientRequest | None:
        return self._by_engine_id.get(engine_id)

    def find(self, identity: bytes, request_id: str) -> ClientRequest | None:
        """The request a client calls ``request_id`` on its connection."""
        return self._by_client.get((identity, request_id))

    def pop(self, engine_id: str) -> ClientRequest | None:
        req = self._by_engine_id.pop(engine_id, None)
        if req is not None:
            self._by_client.pop((req.identity, req.request_id), None)
        return req

    def clear(self) -> list[ClientRequest]:
        """Empty the table; returns what it held."""
        held = list(self._by_engine_id.values())
        self._by_engine_id.clear()
        self._by_client.clear()
        return held

    def __len__(self) -> int:
        return len(self._by_engine_id)

    def __iter__(self) -> Iterator[ClientRequest]:
        return iter(list(self._by_engine_id.values()))
