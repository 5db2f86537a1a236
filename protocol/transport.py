"""The ZMQ socket setup shared by the coordinator and its workers."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

# ZMTP heartbeats, answered by ZMQ's I/O threads (so a long step never misses one): a peer silent this long is
# disconnected, and both sides watch for that (workers on other hosts included).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


class WatchedSocket:
    """A socket with heartbeats and a monitor that reports dropped connections, polled together; with
    ``watch_handshakes``, ``connected`` turns true once a peer completes the ZMTP handshake."""

    def __init__(self, ctx: zmq.Context, kind: int, linger_ms: int, watch_handshakes: bool = False) -> None:
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        events = zmq.EVENT_DISCONNECTED | (zmq.EVENT_HANDSHAKE_SUCCEEDED if watch_handshakes else 0)
        self.monitor = self.sock.get_monitor_socket(events)
        self.connected = False
        self.dropped = False
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def poll(self, timeout_ms: int) -> tuple[bool, bool]:
        """(a message is waiting, a connection dropped); a drop stays reported."""
        ready = dict(self.poller.poll(timeout_ms))
        if self.monitor in ready:
            while self.monitor.poll(0):
                event = recv_monitor_message(self.monitor)["event"]
                self.connected |= event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                self.dropped |= event == zmq.EVENT_DISCONNECTED
        return self.sock in ready, self.dropped

    def close(self, linger_ms: int) -> None:
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)
