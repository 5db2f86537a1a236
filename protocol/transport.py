"""The ZMQ socket setup shared by the coordinator and its workers."""

from __future__ import annotations

import zmq

# ZMTP heartbeats, answered by ZMQ's I/O threads (so a long step never misses one): a peer silent this long is
# disconnected, and both sides watch for that (workers on other hosts included).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


class WatchedSocket:
    """A socket with heartbeats and a monitor that reports dropped connections, polled together."""

    def __init__(self, ctx: zmq.Context, kind: int, linger_ms: int) -> None:
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def poll(self, timeout_ms: int) -> tuple[bool, bool]:
        """(a message is waiting, a connection dropped)."""
        ready = dict(self.poller.poll(timeout_ms))
        return self.sock in ready, self.monitor in ready

    def close(self, linger_ms: int) -> None:
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)
