"""Fairness between the server's clients, over the request table's counts (coordinator/request_table.py):

- the per-client pending limit (--max-pending-per-client): a client is a connection (ZMQ identity) plus the label
  its Generate carries (``Generate.client``: the HTTP front-end names its users), and past the limit its further
  requests are refused Overloaded, so that one client's burst leaves the rest of the queue to the others;
- the heartbeat timeout (--client-heartbeat-timeout): a connection with requests pending that sends nothing (no
  request, no KeepAlive) for that long has died or lost its host, since clients send a KeepAlive every second while
  they have requests in flight; its requests are aborted so that they do not hold the queue and KV blocks. ZMQ's
  ROUTER does not say which connection dropped, hence this application-level heartbeat.
"""

from __future__ import annotations

import time

from coordinator.request_table import ClientRequest, RequestTable

DEFAULT_MAX_PENDING_PER_CLIENT = 1024  # W1's 256 at once, 4x over; a quarter of the default 4,096 pending
DEFAULT_CLIENT_HEARTBEAT_TIMEOUT_S = 10.0  # clients send a KeepAlive a second: ten missed on a loaded host
CLIENT_CHECK_S = 1.0  # how often the connections' silence is checked (not every step: it walks them all)
MIN_HEARTBEAT_TIMEOUT_S = 3.0  # a few of the clients' one-second beats


class ClientLimits:
    def __init__(
        self,
        max_pending_requests: int,
        max_pending_per_client: int | None = None,
        heartbeat_timeout_s: float = DEFAULT_CLIENT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        if max_pending_per_client is None:
            max_pending_per_client = min(DEFAULT_MAX_PENDING_PER_CLIENT, max_pending_requests)
        if max_pending_per_client < 1:
            raise ValueError("max_pending_per_client must be >= 1")
        if heartbeat_timeout_s and heartbeat_timeout_s < MIN_HEARTBEAT_TIMEOUT_S:
            raise ValueError(f"client_heartbeat_timeout_s must be 0 (never) or >= {MIN_HEARTBEAT_TIMEOUT_S:g} seconds")
        self.max_pending_per_client = max_pending_per_client
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._checked = time.monotonic()

    def refusal(self, requests: RequestTable, identity: bytes, client: str) -> str | None:
        """The Overloaded message for a new request of a client at its limit; None while it is under it."""
        limit = self.max_pending_per_client
        if requests.pending_of(identity, client) < limit:
            return None
        who = f"client {client!r}" if client else "this client"
        return (
            f"overloaded: {who} has {limit} requests pending, the per-client limit (--max-pending-per-client "
            f"{limit}); retry later"
        )

    def silent(self, requests: RequestTable, emptied_at: float) -> list[tuple[bytes, float, list[ClientRequest]]]:
        """The connections silent for the heartbeat timeout: (identity, seconds silent, its requests); checked at
        most every CLIENT_CHECK_S. ``emptied_at``: when the socket was last found empty, up to which every frame
        sent has been read, so that a loop busy for a while mistakes no live client for a silent one."""
        now = time.monotonic()
        if not self.heartbeat_timeout_s or now - self._checked < CLIENT_CHECK_S:
            return []
        self._checked = now
        found = requests.silent_since(emptied_at - self.heartbeat_timeout_s)
        return [(identity, emptied_at - last_seen, reqs) for identity, last_seen, reqs in found]
