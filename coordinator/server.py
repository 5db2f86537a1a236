"""The coordinator's client endpoint: a ZMQ ROUTER socket that serves Generate/Abort/Health/Info/Stats requests
(protocol/client_messages.py) and drives the engine.

One thread runs one loop:

1. receive: drain the client socket without blocking (at most ``max_drain`` frames per turn, so a flood cannot
   starve the engine), decode and validate each frame, then ``engine.add_request`` / ``engine.abort`` or answer
   Health/Info/Stats on the spot. A frame that cannot be attributed to a request is logged and dropped; a
   malformed frame that names a request gets an ``Error`` reply.
2. step: when the engine has work, run one ``engine.step()`` and send each request's new tokens (streaming)
   or its completion (non-streaming).
3. when idle, block in ``poll`` for a short while (and check that the workers are alive now and then).

Sends never block: ROUTER_MANDATORY is off and every send is non-blocking, so a reply to a vanished client is
dropped and a slow client only loses replies past its high-water mark; neither stalls the loop.

Faults: when the engine fails (a worker died or hung: ``EngineDeadError``), every in-flight request gets an
``EngineDeadError`` reply at once, the surviving workers are stopped, and the server *stays up, unhealthy*:
Health says so and every new Generate gets ``EngineDeadError``. It does not restart the workers (their state
and the model's memory are gone with them; a supervisor that watches Health restarts the whole process, which
is simpler and safer than restarting in place). ``stop()`` (the SIGINT/SIGTERM handlers call it) ends the loop;
in-flight requests then end with finish_reason "abort".
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass

import msgpack
import zmq

from coordinator.prompts import detokenize_reply, tokenize_reply
from coordinator.sequence import Sequence
from protocol.client_messages import (
    CLIENT_PROTOCOL_VERSION,
    CLIENT_REQUEST_TAGS,
    CLIENT_REQUESTS,
    ENGINE_DEAD,
    OVERLOADED,
    PROTOCOL,
    REQUEST_ERROR,
    Abort,
    ChatPrompt,
    Delta,
    Error,
    Generate,
    Health,
    HealthReply,
    Info,
    InfoReply,
    Stats,
    StatsReply,
    Tokenize,
    TokenLogprobs,
)
from protocol.codec import ProtocolError, decode, encode
from protocol.errors import RequestError
from protocol.sampling_params import SamplingParams

log = logging.getLogger("nanoserve.server")

IDLE_POLL_MS = 50
WORKER_CHECK_S = 1.0
RATE_WINDOW_S = 5.0
MAX_REQUEST_ID_LEN = 256
_PARAM_FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


class PortInUseError(OSError):
    pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(slots=True, eq=False)
class _Request:
    identity: bytes
    request_id: str  # the client's id (unique per client connection)
    seq: Sequence
    stream: bool
    holdback: int  # streaming: characters held back because they may start a stop string
    sent_chars: int = 0


class _RateLimitedLog:
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


class Server:
    """Binds at construction (so a port in use fails before any model is loaded); ``serve(engine)`` runs the
    loop until ``stop()``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8765,
        token: str | None = None,
        max_pending_requests: int = 4096,
        max_message_bytes: int = 8 << 20,
        send_hwm: int = 100_000,
        max_drain: int = 4096,
    ) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(f"binding the non-loopback host {host!r} needs a shared-secret token (--token)")
        if max_pending_requests < 1:
            raise ValueError("max_pending_requests must be >= 1")
        self.token = token.encode() if token else None
        self.max_pending_requests = max_pending_requests
        self.max_drain = max_drain
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

        self.engine = None
        self.requests: dict[str, _Request] = {}  # engine request id -> request
        self.by_client: dict[tuple[bytes, str], str] = {}  # (identity, client request id) -> engine request id
        self._ids = itertools.count()
        self.healthy = True
        self.dead_reason = ""
        self._stopping = False
        self._warn = _RateLimitedLog()
        self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self._started = time.monotonic()
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_rejected = 0
        self.frames_dropped = 0
        self.replies_dropped = 0

    # ---- the loop ------------------------------------------------------------------------------------------

    def stop(self, *_args) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._stopping = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGTERM, self.stop)

    def serve(self, engine) -> None:
        """Run until ``stop()``; then end every in-flight request with finish_reason "abort". The caller shuts
        the engine down and closes the server."""
        self.engine = engine
        self.max_model_len = engine.max_model_len
        vocab = engine.tokenizer.get_vocab()
        longest_token = max((len(t) for t in vocab), default=16)
        # a string longer than this cannot fit in max_model_len tokens: reject it before tokenizing it
        self.max_prompt_chars = engine.max_model_len * max(16, 2 * longest_token)
        self._started = time.monotonic()
        last_check = time.monotonic()
        while not self._stopping:
            busy = self.healthy and engine.has_unfinished
            if not busy:
                try:
                    self.sock.poll(IDLE_POLL_MS)
                except zmq.ZMQError:  # interrupted by a signal: look at the stop flag
                    continue
            self._drain()
            if self._stopping:
                break
            if self.healthy and engine.has_unfinished:
                self._step()
            elif self.healthy and time.monotonic() - last_check > WORKER_CHECK_S:
                last_check = time.monotonic()
                self._check_workers()
        self._abort_all("server shutting down")

    def close(self, linger_ms: int = 1000) -> None:
        """Close the socket, giving queued replies (e.g. the final "abort" deltas) ``linger_ms`` to go out."""
        if not self.sock.closed:
            self.sock.close(linger=linger_ms)
        self.ctx.term()

    def _drain(self) -> None:
        for _ in range(self.max_drain):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:  # e.g. interrupted by a signal
                if e.errno != zmq.EINTR:
                    log.warning("receive failed: %s", e)
                return
            try:
                self._handle(frames)
            except Exception:  # a bug must not take the server down
                log.exception("error handling a client frame")
                self.frames_dropped += 1

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as e:  # EngineDeadError, a hang (TimeoutError), or anything else: the state is unknown
            self._engine_died(e)
            return
        now = time.monotonic()
        self._rate.append((now, len(outputs)))
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
            self._rate.popleft()
        for out in outputs:
            req = self.requests.get(out.seq.request_id)
            if req is None:
                continue
            if out.finished:
                self._finish(req, out.new_token_ids if req.stream else None, out.new_logprobs)
            elif req.stream:
                self._stream_delta(req, out.new_token_ids, out.new_logprobs)

    # ---- replies -------------------------------------------------------------------------------------------

    def _send(self, identity: bytes, msg) -> None:
        try:
            self.sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:  # Again (full) or a vanished peer: drop, never stall
            self.replies_dropped += 1

    def _error(self, identity: bytes, request_id: str, kind: str, message: str) -> None:
        if kind != ENGINE_DEAD:
            self.requests_rejected += 1
        self._send(identity, Error(request_id, kind, message))

    @staticmethod
    def _logprobs(seq: Sequence, logprobs: list[dict[int, float]] | None) -> list[TokenLogprobs] | None:
        if seq.params.logprobs is None:
            return None
        return [TokenLogprobs.from_dict(d) for d in logprobs or []]

    def _stream_delta(self, req: _Request, new_token_ids: list[int], new_logprobs=None) -> None:
        seq = req.seq
        text = ""
        # before min_tokens a stop string is not matched yet, but would be later, at its earlier position
        if not (seq.params.stop and len(seq.output_token_ids) < seq.params.min_tokens):
            ready = len(seq.text) - req.holdback
            if ready > req.sent_chars:
                text = seq.text[req.sent_chars : ready]
                req.sent_chars = ready
        logprobs = self._logprobs(seq, new_logprobs)
        self._send(req.identity, Delta(req.request_id, list(new_token_ids), text, None, logprobs=logprobs))

    def _finish(self, req: _Request, new_token_ids: list[int] | None, new_logprobs=None) -> None:
        """The last Delta: streaming sends the tokens of this step and the rest of the text; non-streaming sends
        everything."""
        self.requests.pop(req.seq.request_id, None)
        self.by_client.pop((req.identity, req.request_id), None)
        seq = req.seq
        completion = self.engine.completion(seq)
        if req.stream:
            sent = seq.text[: req.sent_chars]
            rest = completion.text[req.sent_chars :] if completion.text.startswith(sent) else seq.text[req.sent_chars :]
            token_ids, text, logprobs = list(new_token_ids or []), rest, new_logprobs
        else:
            token_ids, text, logprobs = completion.token_ids, completion.text, completion.logprobs
        reason = completion.finish_reason or "abort"
        self.requests_finished += 1
        self.requests_aborted += reason == "abort"
        self._send(
            req.identity,
            Delta(
                req.request_id,
                token_ids,
                text,
                reason,
                completion.stop_reason,
                completion.prompt_token_ids,
                self._logprobs(seq, logprobs if token_ids else None),
            ),
        )

    def _abort_all(self, why: str) -> None:
        if self.requests:
            log.info("%s: aborting %d in-flight request(s)", why, len(self.requests))
        for engine_id, req in list(self.requests.items()):
            if self.healthy:
                self.engine.abort(engine_id)
            self._finish(req, [])

    def _engine_died(self, e: BaseException) -> None:
        self.healthy = False
        self.dead_reason = f"{type(e).__name__}: {e}"
        log.error("engine failed, serving as unhealthy from now on: %s", self.dead_reason)
        message = f"the engine is dead: {self.dead_reason}"
        for req in self.requests.values():
            self._send(req.identity, Error(req.request_id, ENGINE_DEAD, message))
        self.requests.clear()
        self.by_client.clear()
        try:  # stop the surviving workers (frees their devices); bounded by the worker group's own timeout
            self.engine.shutdown()
        except Exception:
            log.exception("error stopping the workers")

    def _check_workers(self) -> None:
        try:
            self.engine.workers.check_alive()
        except Exception as e:
            self._engine_died(e)

    # ---- requests ------------------------------------------------------------------------------------------

    def _drop(self, identity: bytes, why: str) -> None:
        self.frames_dropped += 1
        self._warn("dropping a frame from client %s: %s", identity.hex()[:16], why)

    def _unauthorized(self, identity: bytes, rid: str) -> None:
        self._warn("rejecting a request from client %s: missing or wrong token", identity.hex()[:16])
        self._error(identity, rid[:MAX_REQUEST_ID_LEN], PROTOCOL, "unauthorized: missing or wrong token")

    def _token_ok(self, token) -> bool:
        if self.token is None:
            return True
        return isinstance(token, str) and hmac.compare_digest(token.encode(), self.token)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._drop(frames[0] if frames else b"", f"expected 2 frames (identity, message), got {len(frames)}")
            return
        identity, data = frames
        try:
            msg = decode(data)
        except ProtocolError as e:
            self._reject_malformed(identity, data, e)
            return
        if not isinstance(msg, CLIENT_REQUESTS):
            self._drop(identity, f"not a client request: {type(msg).__name__}")
            return
        rid = msg.request_id
        if not self._token_ok(msg.token):
            self._unauthorized(identity, rid)
            return
        if msg.protocol_version != CLIENT_PROTOCOL_VERSION:
            self._error(
                identity,
                rid,
                PROTOCOL,
                f"protocol_version {msg.protocol_version} is not supported; the server speaks "
                f"{CLIENT_PROTOCOL_VERSION}",
            )
            return
        if not rid or len(rid) > MAX_REQUEST_ID_LEN:
            self._error(identity, rid[:MAX_REQUEST_ID_LEN], REQUEST_ERROR, "request_id must be 1-256 characters")
            return
        if isinstance(msg, Generate):
            self._generate(identity, msg)
        elif isinstance(msg, Abort):
            self._abort(identity, rid)
        elif isinstance(msg, Health):
            if self.healthy:
                self._check_workers()
            self._send(identity, HealthReply(rid, self.healthy, "ok" if self.healthy else self.dead_reason))
        elif isinstance(msg, Info):
            self._send(identity, self._info(rid))
        elif isinstance(msg, Stats):
            self._send(identity, self._stats(rid))
        else:  # Tokenize / Detokenize
            try:
                reply = (tokenize_reply if isinstance(msg, Tokenize) else detokenize_reply)(self.engine, msg)
            except RequestError as e:
                self._error(identity, rid, REQUEST_ERROR, str(e))
                return
            self._send(identity, reply)

    def _reject_malformed(self, identity: bytes, data: bytes, e: ProtocolError) -> None:
        """A frame the codec rejected: answer it if it names a request (tag, version, request_id, token in
        place), otherwise drop it."""
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
            if not self._token_ok(raw[3]):
                self._unauthorized(identity, raw[2])
                return
            if raw[1] != CLIENT_PROTOCOL_VERSION:
                why = f"protocol_version {raw[1]!r} is not supported; the server speaks {CLIENT_PROTOCOL_VERSION}"
            else:
                why = f"malformed request: {e}"
            self._error(identity, raw[2], PROTOCOL, why)
            return
        self._drop(identity, str(e))

    def _generate(self, identity: bytes, msg: Generate) -> None:
        rid = msg.request_id
        if not self.healthy:
            self._error(identity, rid, ENGINE_DEAD, f"the engine is dead: {self.dead_reason}")
            return
        if (identity, rid) in self.by_client:
            self._error(identity, rid, REQUEST_ERROR, f"request_id {rid!r} is already in flight")
            return
        if len(self.requests) >= self.max_pending_requests:
            self._error(identity, rid, OVERLOADED, f"overloaded: {len(self.requests)} requests pending; retry later")
            return
        try:
            prompt = self._check_prompt(msg.prompt)
            params = self._params(msg)
            engine_id = str(next(self._ids))
            seq = self.engine.add_request(prompt, params, engine_id)
        except RequestError as e:
            self._error(identity, rid, REQUEST_ERROR, str(e))
            return
        except Exception as e:  # e.g. the tokenizer choking on something: still the request's fault
            log.warning("request %r rejected: %s: %s", rid, type(e).__name__, e)
            self._error(identity, rid, REQUEST_ERROR, f"invalid request: {type(e).__name__}: {e}")
            return
        seq.stream = msg.stream
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self.requests[engine_id] = _Request(identity, rid, seq, msg.stream, holdback)
        self.by_client[(identity, rid)] = engine_id

    def _check_prompt(self, prompt) -> str | list[int] | ChatPrompt:
        if isinstance(prompt, ChatPrompt):  # the engine checks the conversation and its length once rendered
            return prompt
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            if len(prompt) > self.max_prompt_chars:
                raise RequestError(
                    f"prompt ({len(prompt)} characters) cannot fit in max_model_len ({self.max_model_len}) tokens"
                )
            return prompt
        if isinstance(prompt, list):
            if not prompt:
                raise RequestError("prompt is empty")
            if len(prompt) > self.max_model_len:
                raise RequestError(f"prompt ({len(prompt)} tokens) exceeds max_model_len ({self.max_model_len})")
            if not all(type(t) is int for t in prompt):
                raise RequestError("prompt must be a string or a list of int token ids")
            return prompt
        raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    @staticmethod
    def _params(msg: Generate) -> SamplingParams:
        try:
            return SamplingParams(**{name: getattr(msg, name) for name in _PARAM_FIELDS})
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from None

    def _abort(self, identity: bytes, rid: str) -> None:
        engine_id = self.by_client.get((identity, rid))
        if engine_id is None:
            return  # finished already, or never existed: nothing to free
        req = self.requests[engine_id]
        self.engine.abort(engine_id)  # frees its KV blocks and its worker slot
        self._finish(req, [])

    # ---- Info / Stats --------------------------------------------------------------------------------------

    def _info(self, rid: str) -> InfoReply:
        e = self.engine
        bm = e.block_manager
        return InfoReply(
            request_id=rid,
            protocol_version=CLIENT_PROTOCOL_VERSION,
            model=e.config.model,
            max_model_len=e.max_model_len,
            tensor_parallel_size=e.config.tensor_parallel_size,
            device=e.config.device,
            vocab_size=e.vocab_size,
            block_size=bm.block_size,
            kv_blocks_total=bm.num_blocks,
            kv_capacity_tokens=bm.num_blocks * bm.block_size,
            max_num_seqs=e.config.max_num_seqs,
            worker_pids=[p.pid for p in e.workers.procs],
            coordinator_pid=os.getpid(),
            generation_defaults=e.generation_defaults,
        )

    def _stats(self, rid: str) -> StatsReply:
        s = self.engine.stats()
        now = time.monotonic()
        window = min(RATE_WINDOW_S, max(now - self._started, 1e-3))
        recent = sum(n for t, n in self._rate if t >= now - window)
        hits, computed = s["prefix_cache_hit_tokens"], s["prompt_tokens"]
        total, free = s["kv_blocks_total"], s["kv_blocks_free"]
        return StatsReply(
            request_id=rid,
            healthy=self.healthy,
            running=s["running"],
            waiting=s["waiting"],
            pending=len(self.requests),
            kv_blocks_total=total,
            kv_blocks_free=free,
            kv_usage=(total - free) / total if total else 0.0,
            prefix_cache_hit_tokens=hits,
            prefix_cache_hit_rate=hits / (hits + computed) if hits + computed else 0.0,
            prompt_tokens=computed,
            output_tokens=s["output_tokens"],
            tokens_per_s=recent / window,
            steps=s["steps"],
            preemptions=s["preemptions"],
            requests_finished=self.requests_finished,
            requests_aborted=self.requests_aborted,
            requests_rejected=self.requests_rejected,
            frames_dropped=self.frames_dropped,
            replies_dropped=self.replies_dropped,
        )
