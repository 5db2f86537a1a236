"""Reading a client's frame at the server: decode, authenticate, check the protocol version and the request id.

``read_frame`` turns the frames of one ZMQ message into a request to serve, an ``Error`` to answer (the frame names
a request), or a reason to drop it (it names none). It never raises on bad input.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass

import msgpack

from protocol.client_messages import (
    CLIENT_PROTOCOL_VERSION,
    CLIENT_REQUEST_TAGS,
    CLIENT_REQUESTS,
    PROTOCOL,
    REQUEST_ERROR,
    Error,
    Generate,
)
from protocol.codec import InvalidValue, ProtocolError, decode

log = logging.getLogger("nanoserve.server")

MAX_REQUEST_ID_LEN = 256
MAX_CLIENT_LABEL_LEN = 256  # Generate.client: a key of the server's per-client counts


@dataclass(slots=True)
class Frame:
    """One client message, read: exactly one of ``request``, ``error`` and ``drop`` is set."""

    identity: bytes
    request: object = None  # a decoded, authorized request of this protocol version with a valid request id
    error: Error | None = None  # answer this (the request is refused)
    drop: str | None = None  # why the frame is dropped unanswered
    unauthorized: bool = False  # the error is a missing or wrong token (worth a warning)


def token_ok(token: object, secret: bytes | None) -> bool:
    if secret is None:
        return True
    return isinstance(token, str) and hmac.compare_digest(token.encode(), secret)


def _unauthorized(identity: bytes, rid: str) -> Frame:
    err = Error(rid[:MAX_REQUEST_ID_LEN], PROTOCOL, "unauthorized: missing or wrong token")
    return Frame(identity, error=err, unauthorized=True)


def _version_error(version: object) -> str:
    return f"protocol_version {version!r} is not supported; the server speaks {CLIENT_PROTOCOL_VERSION}"


def read_frame(frames: list[bytes], secret: bytes | None) -> Frame:
    if len(frames) != 2:
        return Frame(frames[0] if frames else b"", drop=f"expected 2 frames (identity, message), got {len(frames)}")
    identity, data = frames
    try:
        msg = decode(data)
    except ProtocolError as e:
        return _read_malformed(identity, data, e, secret)
    if not isinstance(msg, CLIENT_REQUESTS):
        return Frame(identity, drop=f"not a client request: {type(msg).__name__}")
    rid = msg.request_id
    if not token_ok(msg.token, secret):
        return _unauthorized(identity, rid)
    if msg.protocol_version != CLIENT_PROTOCOL_VERSION:
        return Frame(identity, error=Error(rid, PROTOCOL, _version_error(msg.protocol_version)))
    if not rid or len(rid) > MAX_REQUEST_ID_LEN:
        return Frame(
            identity, error=Error(rid[:MAX_REQUEST_ID_LEN], REQUEST_ERROR, "request_id must be 1-256 characters")
        )
    if isinstance(msg, Generate) and len(msg.client) > MAX_CLIENT_LABEL_LEN:
        return Frame(
            identity, error=Error(rid, REQUEST_ERROR, f"client must be at most {MAX_CLIENT_LABEL_LEN} characters")
        )
    if isinstance(msg, Generate):
        try:  # where a client's settings enter the system: their one semantic check (decoding checked types)
            msg.params.validate()
        except (ValueError, TypeError) as e:  # read_frame never raises on bad input
            return Frame(identity, error=Error(rid, REQUEST_ERROR, str(e)))
    return Frame(identity, request=msg)


def _read_malformed(identity: bytes, data: bytes, e: ProtocolError, secret: bytes | None) -> Frame:
    """A frame the codec rejected: answered if it names a request (tag, version, request_id, token in place),
    otherwise dropped."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        raw = None
    if (
        isinstance(raw, list)
        and len(raw) >= 4
        and type(raw[0]) is int
        and raw[0] in CLIENT_REQUEST_TAGS
        and isinstance(raw[2], str)
        and 0 < len(raw[2]) <= MAX_REQUEST_ID_LEN
    ):
        if not token_ok(raw[3], secret):
            return _unauthorized(identity, raw[2])
        if raw[1] != CLIENT_PROTOCOL_VERSION:
            return Frame(identity, error=Error(raw[2], PROTOCOL, _version_error(raw[1])))
        if isinstance(e, InvalidValue):  # well-formed, but e.g. a sampling setting out of range
            return Frame(identity, error=Error(raw[2], REQUEST_ERROR, str(e)))
        return Frame(identity, error=Error(raw[2], PROTOCOL, f"malformed request: {e}"))
    return Frame(identity, drop=str(e))


class RateLimitedLog:
    """At most ``per_s`` warnings a second, so a flood of garbage cannot flood the log."""

    def __init__(self, per_s: int = 10) -> None:
        self.per_s, self.window, self.count, self.suppressed = per_s, 0, 0, 0

    def __call__(self, msg: str, *args) -> None:
        now = int(time.monotonic())
        if now != self.window:
            if self.suppressed:
                log.warning("... %d more dropped-frame warning(s) suppressed", self.suppressed)
            self.window, self.count, self.suppressed = now, 0, 0
        if self.count < self.per_s:
            self.count += 1
            log.warning(msg, *args)
        else:
            self.suppressed += 1
