"""The server's table of requests in flight: which client (ZMQ identity) and client request id each engine request
answers to. Client ids are scoped to a connection; the engine's ids are the server's own.

It also keeps, in O(1) per request, what fairness between clients needs: the requests pending per client (a
connection plus the optional ``Generate.client`` label, e.g. the HTTP front-end's user) for the per-client limit,
and per connection with requests pending, its requests and when it was last heard from, for the heartbeat timeout.
A connection or client with nothing pending has no entry, so the table never grows with clients that came and went.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class ClientRequest:
    identity: bytes  # the client's connection
    request_id: str  # the client's id for it
    engine_id: str  # the engine's id for it
    client: str = ""  # the label within the connection (Generate.client)


@dataclass(slots=True, eq=False)
class _Connection:
    """A connection with requests pending."""

    last_seen: float  # time.monotonic() of its last frame read
    requests: dict[str, ClientRequest] = field(default_factory=dict)  # by engine id


class RequestTable:
    def __init__(self) -> None:
        self._by_engine_id: dict[str, ClientRequest] = {}
        self._by_client: dict[tuple[bytes, str], ClientRequest] = {}
        self._pending: dict[tuple[bytes, str], int] = {}  # (identity, client label) -> requests pending
        self._connections: dict[bytes, _Connection] = {}
        self._ids = itertools.count()

    def new_engine_id(self) -> str:
        return str(next(self._ids))

    def add(self, identity: bytes, request_id: str, engine_id: str, client: str = "") -> None:
        req = ClientRequest(identity, request_id, engine_id, client)
        self._by_engine_id[engine_id] = req
        self._by_client[(identity, request_id)] = req
        key = (identity, client)
        self._pending[key] = self._pending.get(key, 0) + 1
        conn = self._connections.get(identity)
        if conn is None:
            conn = self._connections[identity] = _Connection(time.monotonic())
        conn.requests[engine_id] = req

    def get(self, engine_id: str) -> ClientRequest | None:
        return self._by_engine_id.get(engine_id)

    def find(self, identity: bytes, request_id: str) -> ClientRequest | None:
        """The request a client calls ``request_id`` on its connection."""
        return self._by_client.get((identity, request_id))

    def pop(self, engine_id: str) -> ClientRequest | None:
        req = self._by_engine_id.pop(engine_id, None)
        if req is not None:
            self._by_client.pop((req.identity, req.request_id), None)
            key = (req.identity, req.client)
            left = self._pending[key] - 1
            if left:
                self._pending[key] = left
            else:
                del self._pending[key]
            conn = self._connections[req.identity]
            del conn.requests[engine_id]
            if not conn.requests:
                del self._connections[req.identity]
        return req

    def clear(self) -> list[ClientRequest]:
        """Empty the table; returns what it held."""
        held = list(self._by_engine_id.values())
        self._by_engine_id.clear()
        self._by_client.clear()
        self._pending.clear()
        self._connections.clear()
        return held

    # ---- fairness ------------------------------------------------------------------------------------------

    def pending_of(self, identity: bytes, client: str = "") -> int:
        """Requests pending for one client: a connection and its label."""
        return self._pending.get((identity, client), 0)

    @property
    def clients(self) -> int:
        """Clients (connection, label) with requests pending."""
        return len(self._pending)

    def seen(self, identity: bytes, now: float) -> None:
        """A frame from ``identity`` was read at ``now``: it is alive (only connections with requests count)."""
        conn = self._connections.get(identity)
        if conn is not None:
            conn.last_seen = now

    def of_connection(self, identity: bytes) -> list[ClientRequest]:
        """The requests pending on one connection."""
        conn = self._connections.get(identity)
        return [] if conn is None else list(conn.requests.values())

    def silent_since(self, before: float) -> list[tuple[bytes, float, list[ClientRequest]]]:
        """The connections not heard from since ``before``: (identity, last seen, its requests pending)."""
        return [
            (identity, conn.last_seen, list(conn.requests.values()))
            for identity, conn in self._connections.items()
            if conn.last_seen < before
        ]

    def __len__(self) -> int:
        return len(self._by_engine_id)

    def __iter__(self) -> Iterator[ClientRequest]:
        return iter(list(self._by_engine_id.values()))
