"""The asyncio client's link to a coordinator on this host over its local socket (``unix:PATH``,
coordinator/local_socket.py): the HTTP front-end's way in. It stands where the client's ZMQ DEALER socket stands and
answers the few calls the asyncio client makes of one (the descriptor, whether a message is waiting, a receive that
never waits, a send that never waits), so the client's code is one for both.

A message is framed by its length (protocol/stream_frames.py). Sends go out at once where the kernel takes them;
the rest waits for the socket to drain (a writer on the running loop), in order. The server's end closing is a
ConnectionError for every request waiting, at once: no heartbeat is needed to notice it."""

from __future__ import annotations

import asyncio
import socket
from collections import deque

import zmq

from protocol.stream_frames import READ_BYTES, FrameBuffer, FrameTooLargeError, append_framed

MAX_REPLY_BYTES = 1 << 31  # replies are the server's own; this only bounds a corrupted length


class LocalLink:
    """Connected at once (the coordinator binds its socket before it starts its front-end); ConnectionError if
    nothing listens at the path."""

    def __init__(self, address: str) -> None:
        self.address, self.path = address, address.removeprefix("unix:")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(self.path)
        except OSError as e:
            self.sock.close()
            raise ConnectionError(f"no server answers at {address}: {e}") from None
        self.sock.setblocking(False)
        self._frames = FrameBuffer(MAX_REPLY_BYTES)
        self._ready: deque[bytes] = deque()
        self._unsent = bytearray()
        self._writing: asyncio.AbstractEventLoop | None = None  # the loop whose writer drains _unsent
        self.closed = False
        self._error: str | None = None  # why the link broke
        self._drained = False

    def getsockopt(self, option: int) -> int:
        """``zmq.FD``: the descriptor to watch; ``zmq.EVENTS``: POLLIN while a whole reply is waiting (read here,
        without waiting)."""
        if option == zmq.FD:
            return self.sock.fileno()
        if option == zmq.EVENTS:
            # after a short read the socket is empty: no second receive (a raised EAGAIN) before the replies go
            # out; the loop's reader is level-triggered, so the next call comes once there is more, and reads
            if not self._ready and not self.closed:
                if self._drained:
                    self._drained = False
                else:
                    self._read()
            return zmq.POLLIN if self._ready or self._error is not None else 0
        raise ValueError(f"LocalLink has no option {option}")

    def recv(self, flags: int = 0) -> bytes:
        """The next reply; zmq.Again when none is waiting; ConnectionError once the server's end has closed."""
        if self._ready:
            return self._ready.popleft()
        if self._error is not None:
            raise ConnectionError(self._error)
        raise zmq.Again()

    def send(self, data: bytes, flags: int = 0) -> None:
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "the link is closed")
        append_framed(self._unsent, data)
        self._write()

    def close(self, linger: int | None = None) -> None:
        if not self.closed:
            self.closed = True
            self._stop_writer()
            self.sock.close()

    def _read(self) -> None:
        try:
            while True:
                data = self.sock.recv(READ_BYTES)
                if not data:
                    self._fail(f"the server at {self.address} closed the connection")
                    return
                self._frames.feed(data)
                self._ready.extend(self._frames.take())
                if len(data) < READ_BYTES:
                    self._drained = True
                    return
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, FrameTooLargeError) as e:
            self._fail(f"the connection to {self.address} failed: {e}")

    def _write(self) -> None:
        try:
            while self._unsent:
                del self._unsent[: self.sock.send(self._unsent)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self._unsent.clear()
            self._fail(f"the connection to {self.address} failed: {e}")
        if self._unsent and self._writing is None:
            self._writing = asyncio.get_running_loop()
            self._writing.add_writer(self.sock.fileno(), self._write)
        elif not self._unsent:
            self._stop_writer()

    def _fail(self, why: str) -> None:
        """The link is broken for good: every receive from now raises ``why``, and the loop stops watching the
        descriptor (at its end it would be readable for ever)."""
        self._error = self._error or why
        try:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        except RuntimeError:  # not in a loop
            pass

    def _stop_writer(self) -> None:
        if self._writing is not None:
            if not self._writing.is_closed():
                self._writing.remove_writer(self.sock.fileno())
            self._writing = None
