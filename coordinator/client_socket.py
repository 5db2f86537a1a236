"""The server's ROUTER socket for clients: bound at once (a port in use fails before any model loads), sends that
never block, receives that never wait."""

from __future__ import annotations

import logging
import time

import zmq

log = logging.getLogger("nanoserve.server")


class PortInUseError(OSError):
    pass


class ClientSocket:
    def __init__(self, host: str, port: int, max_message_bytes: int, send_hwm: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to vanished clients are dropped, never raise
        self.sock.setsockopt(zmq.SNDHWM, send_hwm)  # past this, a slow client's replies are dropped
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # a peer sending more is disconnected
        self.sock.setsockopt(zmq.LINGER, 0)
        bare = host.strip("[]")
        if ":" in bare:
            self.sock.setsockopt(zmq.IPV6, 1)
            endpoint = f"tcp://[{bare}]:{port or '*'}"
        else:
            endpoint = f"tcp://{bare}:{port or '*'}"
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.sock.close(linger=0)
            self.ctx.term()
            if e.errno == zmq.EADDRINUSE:
                raise PortInUseError(f"port {port} on {host} is already in use") from None
            raise OSError(f"cannot listen on {endpoint}: {e}") from None
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.address.rsplit(":", 1)[1])
        # when a receive last found nothing waiting: every frame sent before then has been read, so a client
        # silent since long before it is silent indeed, however long the loop itself was busy
        self.emptied_at = time.monotonic()

    def poll(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for a frame; returns early on a signal too."""
        try:
            self.sock.poll(timeout_ms)
        except zmq.ZMQError:  # interrupted by a signal: the caller looks at its stop flag
            pass

    def recv(self) -> list[bytes] | None:
        """The next message's frames, or None when none is waiting."""
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            self.emptied_at = time.monotonic()
            return None
        except zmq.ZMQError as e:  # e.g. interrupted by a signal
            if e.errno != zmq.EINTR:
                log.warning("receive failed: %s", e)
            return None

    def send(self, identity: bytes, data: bytes) -> bool:
        """False when the reply was dropped (the client is gone or past its high-water mark): never stalls."""
        try:
            self.sock.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def close(self, linger_ms: int) -> None:
        if not self.sock.closed:
            self.sock.close(linger=linger_ms)
        self.ctx.term()
