"""Liveness both ways. The client's side: whether its socket has a live connection to its server, so that a call
fails (ConnectionError naming the address) when there is no server or it died, instead of waiting forever, while a
long generation on a live connection is never cut. ZMTP heartbeats (answered by ZMQ's I/O threads on both sides)
drop a silent peer; the socket's monitor reports handshakes and drops. The server's side: while a client has
requests in flight it sends a KeepAlive every ``KEEPALIVE_S`` (the blocking client from a thread of its own, so
that a caller busy elsewhere, not reading, still counts as alive); the server aborts the requests of a connection
silent for its heartbeat timeout, since ZMQ does not tell it which connection dropped."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
DEFAULT_CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_S = 1.0  # the server's heartbeat timeout (default 10 s, at least 3) spans several of these
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def enable_heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


class ConnectionWatch:
    """Tracks the connection of ``sock`` (set up before it connects); ``error()`` is the ConnectionError to raise
    once it has been down for ``timeout_s`` (None: never)."""

    def __init__(self, sock: zmq.Socket, address: str, timeout_s: float | None) -> None:
        self.sock, self.address, self.timeout_s = sock, address, timeout_s
        self.connected = False
        self.down_since = time.monotonic()
        self.monitor = sock.get_monitor_socket(_EVENTS) if timeout_s is not None else None

    def event(self, frames: list[bytes]) -> None:
        kind = parse_monitor_message(frames)["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
        elif kind == zmq.EVENT_DISCONNECTED and self.connected:
            self.connected, self.down_since = False, time.monotonic()

    def drain(self) -> None:
        """Read the monitor's pending events (blocking sockets only)."""
        while self.monitor is not None:
            try:
                self.event(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def error(self) -> ConnectionError | None:
        if self.timeout_s is None or self.connected or time.monotonic() - self.down_since < self.timeout_s:
            return None
        return ConnectionError(f"no server answers at {self.address} (not connected for {self.timeout_s:g} s)")

    def close(self) -> None:
        """Before the socket closes."""
        if self.monitor is not None and not self.monitor.closed:
            if not self.sock.closed:
                self.sock.disable_monitor()
            self.monitor.close(linger=0)


def start_keepalive_thread(owner: object, beat: Callable[[object], None], stop: threading.Event) -> threading.Thread:
    """A daemon thread that calls ``beat(owner)`` every KEEPALIVE_S until ``stop`` is set or ``owner`` is garbage
    (it holds only a weak reference, so a client dropped without ``close()`` is still collected)."""
    ref = weakref.ref(owner)

    def run() -> None:
        while not stop.wait(KEEPALIVE_S):
            obj = ref()
            if obj is None:
                return
            beat(obj)
            del obj

    thread = threading.Thread(target=run, name="nanoserve-keepalive", daemon=True)
    thread.start()
    return thread
