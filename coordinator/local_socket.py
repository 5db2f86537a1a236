"""The coordinator's local socket for its own HTTP front-end: a Unix stream socket in a private directory that carries
the same messages as the client ROUTER socket, each framed by its length (protocol/stream_frames.py).

Why not ZMQ here: a ZMQ message crosses an I/O thread on each side, three thread wake-ups a hop, and after an idle
second each wake-up costs tens to hundreds of microseconds (a round trip: ~0.8-1.0 ms against ~0.2-0.3 ms over a Unix
socket on the CPU box). Both hops of a streamed request's first token go this way.

Each connection gets an identity that ZMQ never makes (a zero byte, then "local" and a 4-byte count: ZMQ's own are 5
bytes, and a ZMQ peer may not choose one that starts with zero), so the request table and the replies need no second
kind of key. As with the ROUTER socket, nothing here blocks the loop: replies are buffered per connection and written
once a loop turn (``flush``); a connection whose unsent replies pass ``max_unsent_bytes`` loses the rest, as a ZMQ
peer past its high-water mark does; one that sends a message over the limit is dropped, as ZMQ's MAXMSGSIZE drops it.
A connection that closes is reported (``take_gone``), so its requests are aborted at once."""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable

import zmq

from coordinator import private_dirs
from protocol.stream_frames import READ_BYTES, FrameBuffer, FrameTooLargeError, append_framed

log = logging.getLogger("nanoserve.server")

MAX_PATH_BYTES = 100  # sun_path holds 108 on Linux
IDENTITY_PREFIX = b"\x00local"


class _Connection:
    __slots__ = ("sock", "identity", "frames", "unsent", "blocked")

    def __init__(self, sock: socket.socket, identity: bytes, max_message_bytes: int) -> None:
        self.sock, self.identity = sock, identity
        self.frames = FrameBuffer(max_message_bytes)
        self.unsent = bytearray()
        self.blocked = False  # replies wait for room: the idle poll watches for it


class LocalSocket:
    """Listens at ``path`` (its directory must be private: anyone who can connect may send requests, each still
    checked against the token). ``watch(fd, events)`` sets what the loop's idle poll waits for on a descriptor
    (coordinator/loop_wake.py): a connection's input, and its output room while replies wait to go out."""

    def __init__(
        self, path: str, max_message_bytes: int, watch: Callable[[int, int], None], max_unsent_bytes: int = 1 << 30
    ) -> None:
        if len(os.fsencode(path)) > MAX_PATH_BYTES:
            raise OSError(f"socket path too long for a Unix socket: {path}")
        self.path, self.address = path, f"unix:{path}"
        self.max_message_bytes, self.max_unsent_bytes = max_message_bytes, max_unsent_bytes
        self._watch = watch
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.listener.setblocking(False)
        watch(self.listener.fileno(), zmq.POLLIN)
        self._conns: dict[bytes, _Connection] = {}
        self._ready: deque[list[bytes]] = deque()  # [identity, message] as the ROUTER socket gives them
        self._gone: list[bytes] = []
        self._ids = itertools.count()
        self.emptied_at = time.monotonic()  # as ClientSocket's: when a receive last found nothing waiting
        self._private_dir: str | None = None

    @classmethod
    def in_private_dir(cls, max_message_bytes: int, watch: Callable[[int, int], None]) -> LocalSocket | None:
        """One in a new private directory (coordinator/private_dirs.py), which ``close`` removes; None where the
        path would be too long for a Unix socket (a long TMPDIR)."""
        tmpdir = private_dirs.create()
        try:
            local = cls(os.path.join(tmpdir, "clients"), max_message_bytes, watch)
        except OSError as e:
            log.info("no local socket for the front-end (%s): it connects over TCP", e)
            private_dirs.remove(tmpdir)
            return None
        local._private_dir = tmpdir
        return local

    def owns(self, identity: bytes) -> bool:
        return identity in self._conns

    def recv(self) -> list[bytes] | None:
        """The next message as [identity, data], or None when none is waiting."""
        if not self._ready:
            self._accept()
            for conn in list(self._conns.values()):
                self._read(conn)
        if self._ready:
            return self._ready.popleft()
        self.emptied_at = time.monotonic()
        return None

    def send(self, identity: bytes, data: bytes) -> bool:
        """Queue a reply for the next ``flush``; False when it was dropped (the connection is gone or too far
        behind)."""
        conn = self._conns.get(identity)
        if conn is None or len(conn.unsent) > self.max_unsent_bytes:
            return False
        append_framed(conn.unsent, data)
        return True

    def flush(self) -> None:
        """Write what each connection can take now; the rest waits for the next turn, which the connection's output
        room then starts (an idle loop would otherwise send a long reply a buffer a poll timeout)."""
        for conn in list(self._conns.values()):
            if conn.unsent:
                try:
                    del conn.unsent[: conn.sock.send(conn.unsent)]
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self._drop(conn, "")
                    continue
                if conn.blocked != bool(conn.unsent):
                    conn.blocked = bool(conn.unsent)
                    self._watch(conn.sock.fileno(), zmq.POLLIN | (zmq.POLLOUT if conn.blocked else 0))

    def take_gone(self) -> list[bytes]:
        """The identities of the connections closed since the last call."""
        gone, self._gone = self._gone, []
        return gone

    def drain(self, linger_ms: int) -> None:
        """Write the unsent replies, waiting up to ``linger_ms`` for room (the loop's last ones: the front-end is
        stopped next)."""
        deadline = time.monotonic() + linger_ms / 1000
        self.flush()
        while any(c.unsent for c in self._conns.values()) and time.monotonic() < deadline:
            waiting = [c.sock for c in self._conns.values() if c.unsent]
            select.select([], waiting, [], max(0.0, deadline - time.monotonic()))
            self.flush()

    def close(self, linger_ms: int) -> None:
        """``drain``, then close everything and remove the socket file."""
        self.drain(linger_ms)
        for conn in list(self._conns.values()):
            self._drop(conn, "")
        self._watch(self.listener.fileno(), 0)
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self._private_dir is not None:
            private_dirs.remove(self._private_dir)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the front-end retries its connect
                log.warning("local socket: accept failed: %s", e)
                return
            sock.setblocking(False)
            identity = IDENTITY_PREFIX + struct.pack(">I", next(self._ids) & 0xFFFF_FFFF)
            self._conns[identity] = _Connection(sock, identity, self.max_message_bytes)
            self._watch(sock.fileno(), zmq.POLLIN)

    def _read(self, conn: _Connection) -> None:
        try:
            while True:
                data = conn.sock.recv(READ_BYTES)
                if not data:
                    self._drop(conn, "")
                    return
                conn.frames.feed(data)
                self._ready.extend([conn.identity, m] for m in conn.frames.take())
                if len(data) < READ_BYTES:
                    return
        except (BlockingIOError, InterruptedError):
            return
        except FrameTooLargeError as e:
            self._drop(conn, str(e))
        except OSError as e:
            self._drop(conn, str(e))

    def _drop(self, conn: _Connection, why: str) -> None:
        if why:
            log.warning("local socket: dropping a connection: %s", why)
        self._conns.pop(conn.identity, None)
        self._watch(conn.sock.fileno(), 0)
        conn.sock.close()
        self._gone.append(conn.identity)
