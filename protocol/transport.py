"""The ZMQ socket setup shared by the coordinator and its workers."""

from __future__ import annotations

import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

# ZMTP heartbeats, answered by ZMQ's I/O threads (so a long step never misses one): a peer silent this long is
# disconnected, and both sides watch for that (workers on other hosts included).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
LAST_WORDS_MS = 200  # how long a newly dropped connection's last message may trail the drop


class WatchedSocket:
    """A socket with heartbeats and a monitor that reports dropped connections, polled together; with
    ``watch_handshakes``, ``connected`` turns true once a peer completes the ZMTP handshake. ``drops`` counts the
    dropped connections (a ROUTER serving several peers checks which of them it was)."""

    def __init__(self, ctx: zmq.Context, kind: int, linger_ms: int, watch_handshakes: bool = False) -> None:
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        events = zmq.EVENT_DISCONNECTED | (zmq.EVENT_HANDSHAKE_SUCCEEDED if watch_handshakes else 0)
        self.monitor = self.sock.get_monitor_socket(events)
        self.connected = False
        self.dropped = False
        self.drops = 0
        self._lock = threading.Lock()  # the monitor is read by ``poll``, or by ``dropped_now`` on another thread
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def poll(self, timeout_ms: int) -> tuple[bool, bool]:
        """(a message is waiting, a connection dropped); a drop stays reported. When a drop is first seen, the
        socket gets a moment more for the peer's last message (a coordinator's Shutdown), which reaches it apart
        from the monitor's event and may come second."""
        with self._lock:
            ready = dict(self.poller.poll(timeout_ms))
            was_dropped = self.dropped
            if self.monitor in ready:
                self._read_monitor()
        has_message = self.sock in ready
        if self.dropped and not was_dropped and not has_message:
            has_message = bool(self.sock.poll(LAST_WORDS_MS))
        return has_message, self.dropped

    def _read_monitor(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            self.connected |= event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            self.dropped |= event == zmq.EVENT_DISCONNECTED
            self.drops += event == zmq.EVENT_DISCONNECTED

    def dropped_now(self) -> bool:
        """For a watchdog thread: whether a connection dropped, read from the monitor only while the owning thread
        is not polling (it is busy elsewhere, e.g. blocked in a collective); the lock hands the monitor over."""
        if self._lock.acquire(blocking=False):
            try:
                if not self.monitor.closed:
                    self._read_monitor()
            finally:
                self._lock.release()
        return self.dropped

    def close(self, linger_ms: int) -> None:
        with self._lock:
            self._close(linger_ms)

    def _close(self, linger_ms: int) -> None:
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)
