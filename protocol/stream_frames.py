"""Messages over a byte stream (the local socket between the coordinator and its HTTP front-end): each one is a
4-byte little-endian length, then that many bytes, the same encoded message a ZMQ frame carries."""

from __future__ import annotations

import struct

_LENGTH = struct.Struct("<I")
HEADER_BYTES = _LENGTH.size
MAX_FRAME_BYTES = 0xFFFF_FFFF
READ_BYTES = 1 << 20  # what either end takes from the stream a receive; a shorter read means it is empty


class FrameTooLargeError(ValueError):
    pass


def append_framed(buf: bytearray, data: bytes) -> None:
    """Append ``data`` to an outgoing buffer with its length in front (the data copied once, not twice)."""
    if len(data) > MAX_FRAME_BYTES:
        raise FrameTooLargeError(f"a message of {len(data)} bytes is over the stream's {MAX_FRAME_BYTES}")
    buf += _LENGTH.pack(len(data))
    buf += data


class FrameBuffer:
    """Bytes as they arrive in, whole messages out. A length over ``max_bytes`` raises FrameTooLargeError before
    its body is buffered (the peer is then dropped, as ZMQ drops one that sends over its MAXMSGSIZE)."""

    __slots__ = ("_buf", "_start", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self._buf = bytearray()
        self._start = 0  # where the next message begins in _buf: taken messages are cut off in one go
        self.max_bytes = max_bytes

    def feed(self, data: bytes) -> None:
        self._buf += data

    def take(self) -> list[bytes]:
        """Every whole message buffered, in order."""
        buf, start, out = self._buf, self._start, []
        end = len(buf)
        # each message copied once (a bytearray slice would copy it twice); the view is released before any resize
        with memoryview(buf) as view:
            while end - start >= HEADER_BYTES:
                (size,) = _LENGTH.unpack_from(buf, start)
                if size > self.max_bytes:
                    raise FrameTooLargeError(f"a message of {size} bytes is over the limit of {self.max_bytes}")
                if end - start - HEADER_BYTES < size:
                    break
                start += HEADER_BYTES
                out.append(bytes(view[start : start + size]))
                start += size
        if start == end:
            buf.clear()
            start = 0
        elif start > 1 << 20:  # a long partial message: drop the bytes already taken
            del buf[:start]
            start = 0
        self._start = start
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._start
