"""The server's handling of client frames (a mixin of coordinator/server.py's ``Server``, split by concern): each
frame read and answered, Generates admitted (short ones on the loop, long texts on the tokenizer threads), Tokenize
and Detokenize on the tokenizer threads, and what those threads finished picked up by the loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from coordinator.client_frames import read_frame
from coordinator.tokenizer_pool import INLINE_CHARS, encoded, text_size
from protocol.client_messages import (
    ABORTED,
    CLIENT_PROTOCOL_VERSION,
    ENGINE_DEAD,
    OVERLOADED,
    REQUEST_ERROR,
    Abort,
    Generate,
    Health,
    HealthReply,
    Info,
    InfoReply,
    KeepAlive,
    Stats,
    Tokenize,
)
from protocol.errors import RequestError

log = logging.getLogger("nanoserve.server")


class ClientFrames:
    """``Server``'s frame handling; it uses the server's socket, request table, limits, lifecycle, tokenizer pool,
    stats and reply helpers (``_send``, ``_send_bytes``, ``_error``, ``_end``, ``_check_health``)."""

    def _handle(self, frames: list[bytes]) -> None:
        frame = read_frame(frames, self.token)
        identity, msg = frame.identity, frame.request
        if msg is not None:  # any request is a sign of life
            self.requests.seen(identity, time.monotonic())
        if frame.drop is not None:
            self.stats.frames_dropped += 1
            self._warn("dropping a frame from client %s: %s", identity.hex()[:16], frame.drop)
        elif frame.error is not None:
            if frame.unauthorized:
                self._warn("rejecting a request from client %s: missing or wrong token", identity.hex()[:16])
            self._error(identity, frame.error.request_id, frame.error.kind, frame.error.message)
        elif isinstance(msg, Generate):
            self._generate(identity, msg)
        elif isinstance(msg, Abort):
            req = self.requests.find(identity, msg.request_id)
            if req is not None:  # else finished already, or never existed: nothing to free
                self._end(req)
        elif isinstance(msg, KeepAlive):
            pass  # never answered: it only keeps the connection's requests alive
        elif isinstance(msg, Health):
            if self.healthy:
                self._check_health()
            healthy = self.healthy and not self.lifecycle.draining  # a balancer stops sending work here
            reason = self.dead_reason or ("" if healthy else "shutting down")
            reply = HealthReply(msg.request_id, healthy, "ok" if healthy else reason)
            self._send(identity, reply)
        elif isinstance(msg, Info):
            info = self.engine.info()
            reply = InfoReply(
                msg.request_id,
                CLIENT_PROTOCOL_VERSION,
                **info,
                max_message_bytes=self.max_message_bytes,
                max_pending_per_client=self.limits.max_pending_per_client,
                client_heartbeat_timeout_s=self.limits.heartbeat_timeout_s,
            )
            self._send(identity, reply)
        elif isinstance(msg, Stats):
            reply = self.stats.reply(
                msg.request_id, self.engine.stats(), self.healthy, len(self.requests), self.requests.clients
            )
            self._send(identity, reply)
        elif len(self.prompts) >= self.max_pending_requests:  # Tokenize / Detokenize from here on
            self._error(identity, msg.request_id, OVERLOADED, f"overloaded: {len(self.prompts)} texts to tokenize")
        else:  # on the tokenizer threads, the reply encoded there too (6M ids: 0.1 s of msgpack); sent by _pick_up
            call = self.engine.tokenize if isinstance(msg, Tokenize) else self.engine.detokenize
            self.prompts.submit(f"t{next(self._job_ids)}", (identity, msg), encoded, call, msg)

    def _pick_up(self) -> None:
        """Answer what the tokenizer threads finished."""
        for job in self.prompts.finished():
            identity, msg = job.context
            self._tokenized(job.key, identity, msg, job.future.result)

    def _tokenized(self, key: str, identity: bytes, msg, result: Callable) -> None:
        """A Generate's ``result()`` (its ids and params) joins the engine, a (De)tokenize's is its encoded reply;
        a refused one gets its error."""
        generate = isinstance(msg, Generate)
        try:
            value = result()
            if generate:
                self.engine.add_admitted(*value, key, msg.stream)
            else:
                self._send_bytes(identity, value)
            return
        except RequestError as e:
            message = str(e)
        except Exception as e:  # e.g. the tokenizer choking on something: still the request's fault
            log.warning("request %r rejected: %s: %s", msg.request_id, type(e).__name__, e)
            message = f"invalid request: {type(e).__name__}: {e}"
        if generate:
            self.requests.pop(key)
        self._error(identity, msg.request_id, REQUEST_ERROR, message)

    def _generate(self, identity: bytes, msg: Generate) -> None:
        rid = msg.request_id
        if self.lifecycle.draining:
            self._error(identity, rid, ABORTED, "the server is shutting down: not taking new requests")
            return
        if not self.healthy:
            self._error(identity, rid, ENGINE_DEAD, f"the engine is dead: {self.dead_reason}")
            return
        if self.requests.find(identity, rid) is not None:
            self._error(identity, rid, REQUEST_ERROR, f"request_id {rid!r} is already in flight")
            return
        if len(self.requests) >= self.max_pending_requests:
            self._error(identity, rid, OVERLOADED, f"overloaded: {len(self.requests)} requests pending; retry later")
            return
        if (refusal := self.limits.refusal(self.requests, identity, msg.client)) is not None:
            self.stats.requests_rejected_per_client += 1
            self._error(identity, rid, OVERLOADED, refusal)
            return
        engine_id = self.requests.new_engine_id()
        self.requests.add(identity, rid, engine_id, msg.client)  # pending (and abortable) while it is tokenized
        if text_size(msg.prompt) <= INLINE_CHARS:  # token ids, a short text: here, without a step's delay
            self._tokenized(engine_id, identity, msg, lambda: self.engine.admit(msg.prompt, msg.params))
        else:
            self.prompts.submit(engine_id, (identity, msg), self.engine.admit, msg.prompt, msg.params)
