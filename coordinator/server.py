"""The coordinator's client endpoint: a ZMQ ROUTER socket (and, for this host's HTTP front-end, a Unix socket carrying
the same messages: coordinator/local_socket.py) that serves Generate/Abort/Health/Info/Stats and
Tokenize/Detokenize requests (protocol/client_messages.py) over the engine's interface (admit, add_admitted, abort,
step, has_unfinished, stats, info, health, tokenize, detokenize, shutdown). It is transport, authentication and the
request table (its counters and Stats answer: coordinator/server_stats.py); the engine's output processor owns every
token and character it sends.

One thread runs one loop:

1. receive: drain the client socket without blocking (at most ``max_drain`` frames per turn, so a flood cannot
   starve the engine), read each frame (coordinator/client_frames.py) and handle it (coordinator/server_frames.py):
   ``engine.abort``, or answer Health/Info/Stats on the spot; a Generate's template and tokenizer
   (``engine.admit``) and Tokenize/Detokenize go to the tokenizer threads (coordinator/tokenizer_pool.py), so a 7 MB
   text cannot stall the other streams. A frame that cannot be attributed to a request is logged and dropped; a
   malformed frame that names a request gets an ``Error`` reply.
2. pick up what the tokenizer threads finished: ``engine.add_admitted``, or the reply.
3. step: when the engine has work, run one ``engine.step()`` and send each of its outputs as a ``Delta``.
4. when idle, block in ``poll`` for a short while (and check the engine's health now and then); a finished
   tokenizer job, ``stop()`` and ``fail()`` wake it at once (coordinator/loop_wake.py).

Sends never block (ROUTER_MANDATORY off, non-blocking sends; the local socket writes a turn's replies at its end): a
reply to a vanished client is dropped, a slow one loses replies past its high-water mark; neither stalls the loop.

Faults and the end (coordinator/lifecycle.py): when the engine fails (a worker died or hung:
``EngineDeadError``), or ``fail(reason)`` is called, every in-flight request gets an ``EngineDeadError`` reply at
once, the surviving workers are stopped, and the loop ends with ``failure`` set: the launcher exits non-zero and a
supervisor restarts the whole process (the workers' state and the model's memory are gone with them: simpler and
safer than restarting in place). ``stop()`` (SIGINT/SIGTERM) drains: new Generates are refused, in-flight ones
run for up to ``shutdown_timeout_s``, and those left then get an ``Aborted`` error; a second ``stop()`` aborts at
once.
"""

from __future__ import annotations

import itertools
import logging
import signal
import time
from typing import TYPE_CHECKING

from coordinator.client_frames import RateLimitedLog
from coordinator.client_limits import DEFAULT_CLIENT_HEARTBEAT_TIMEOUT_S, ClientLimits
from coordinator.client_socket import ClientSocket
from coordinator.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S, Lifecycle
from coordinator.loop_wake import LoopWake
from coordinator.request_table import ClientRequest, RequestTable
from coordinator.server_frames import ClientFrames
from coordinator.server_stats import ServerStats
from coordinator.tokenizer_pool import TokenizerPool
from protocol.client_messages import (
    ABORTED,
    DEFAULT_MAX_MESSAGE_BYTES,
    ENGINE_DEAD,
    Delta,
    Error,
    PromptTokenLogprobs,
    TokenLogprobs,
)
from protocol.codec import encode
from protocol.outputs import StepOutput
from settings.defaults import HOST, MAX_PENDING_REQUESTS, ZMQ_PORT
from settings.loopback import key_refusal

if TYPE_CHECKING:  # the engine pulls in torch; binding the socket must not wait for it
    from coordinator.engine import Engine
    from coordinator.local_socket import LocalSocket

log = logging.getLogger("nanoserve.server")

IDLE_POLL_MS = 50  # the longest idle wait: a frame, a finished tokenizer job, stop() or fail() end it sooner
HEALTH_CHECK_S = 1.0


class Server(ClientFrames):
    """Binds at construction (so a port in use fails before any model is loaded); ``serve(engine)`` runs the
    loop until ``stop()``."""

    def __init__(
        self,
        host: str = HOST,
        port: int = ZMQ_PORT,
        token: str | None = None,
        max_pending_requests: int = MAX_PENDING_REQUESTS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        send_hwm: int = 100_000,
        max_drain: int = 4096,
        max_pending_per_client: int | None = None,
        client_heartbeat_timeout_s: float = DEFAULT_CLIENT_HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        if refusal := key_refusal(host, token, "a shared-secret token (--token)"):
            raise ValueError(refusal)
        if max_pending_requests < 1:
            raise ValueError("max_pending_requests must be >= 1")
        self.token = token.encode() if token else None
        self.max_pending_requests = max_pending_requests
        self.limits = ClientLimits(max_pending_requests, max_pending_per_client, client_heartbeat_timeout_s)
        self.max_drain = max_drain
        self.max_message_bytes = max_message_bytes  # told to clients (Info), which refuse larger requests
        self.socket = ClientSocket(host, port, max_message_bytes, send_hwm)
        self.address, self.port = self.socket.address, self.socket.port
        self.engine: Engine | None = None
        self.requests = RequestTable()
        self.healthy = True
        self.dead_reason = ""
        self.lifecycle = Lifecycle(shutdown_timeout_s)
        self.failure: str | None = None  # why the loop ended, when it was not asked to: the launcher exits 1
        self.wake = LoopWake(self.socket.sock)
        self.local: LocalSocket | None = None  # the HTTP front-end's way in (listen_locally)
        self.prompts = TokenizerPool(on_done=self.wake)  # templates and tokenizers, off the loop; a result wakes it
        self._job_ids = itertools.count()
        self._warn = RateLimitedLog()
        self.stats = ServerStats()

    # ---- the loop ------------------------------------------------------------------------------------------

    def stop(self, *_args) -> None:
        """Drain, then end the loop (signal-safe); a second call aborts at once (coordinator/lifecycle.py)."""
        self.lifecycle.stop()
        self.wake()

    def fail(self, reason: str) -> None:
        """End the loop at once (any thread): in-flight requests get EngineDeadError naming ``reason``, and
        ``failure`` holds it."""
        self.lifecycle.fail(reason)
        self.wake()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGTERM, self.stop)

    def serve(self, engine: Engine) -> None:
        """Run until ``stop()`` has drained (then requests still in flight get an Aborted error), ``fail()``, or the
        engine fails (both: EngineDeadError, and ``failure`` set). The caller shuts the engine down and closes the
        server."""
        self.engine = engine
        self.stats.start(engine.stats()["output_tokens"])
        last_check = time.monotonic()
        while not self.lifecycle.done(len(self.requests) or len(self.prompts)):  # a Generate job is in both
            if not engine.has_unfinished:
                self.wake.wait(IDLE_POLL_MS)
            self._drain()
            self._check_clients()
            self._pick_up()
            if self.local is not None:
                self.local.flush()  # answers and errors now, not after the step
            if self.lifecycle.fail_reason is not None or not self.healthy:
                break
            if engine.has_unfinished:
                self._step()
            elif time.monotonic() - last_check > HEALTH_CHECK_S:
                last_check = time.monotonic()
                self._check_health()
            if self.local is not None:
                self.local.flush()  # the step's replies, one write a connection
        if self.lifecycle.fail_reason is not None and self.healthy:
            self._failed(self.lifecycle.fail_reason)
        self._abort_all(self.lifecycle.abort_message())
        if self.local is not None:
            self.local.drain(1000)  # the front-end is stopped next: its replies must be out first
        self.prompts.close()

    def close(self, linger_ms: int = 1000) -> None:
        """Close the socket, giving queued replies (e.g. the final Aborted errors) ``linger_ms`` to go out."""
        self.socket.close(linger_ms)
        if self.local is not None:
            self.local.close(linger_ms)
        self.wake.close()

    def listen_locally(self) -> str:
        """The HTTP front-end's address: a local socket's (coordinator/local_socket.py), else the client socket's."""
        from coordinator.local_socket import LocalSocket

        self.local = LocalSocket.in_private_dir(self.max_message_bytes, self.wake.watch)
        return self.address if self.local is None else self.local.address

    def _drain(self) -> None:
        for sock in filter(None, (self.socket, self.local)):
            for _ in range(self.max_drain):
                frames = sock.recv()
                if frames is None:
                    break
                try:
                    self._handle(frames)
                except Exception:  # a bug must not take the server down
                    log.exception("error handling a client frame")
                    self.stats.frames_dropped += 1

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
            output_tokens = self.engine.stats()["output_tokens"]
        except Exception as e:  # EngineDeadError, a hang (TimeoutError), or anything else: the state is unknown
            self._engine_died(e)
            return
        self.stats.step(output_tokens)
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is not None:
                self._reply(req, out)

    # ---- replies -------------------------------------------------------------------------------------------

    def _send(self, identity: bytes, msg) -> None:
        self._send_bytes(identity, encode(msg))

    def _send_bytes(self, identity: bytes, data: bytes) -> None:
        sock = self.local if self.local is not None and self.local.owns(identity) else self.socket
        if not sock.send(identity, data):
            self.stats.replies_dropped += 1

    def _error(self, identity: bytes, request_id: str, kind: str, message: str) -> None:
        if kind != ENGINE_DEAD:
            self.stats.requests_rejected += 1
        self._send(identity, Error(request_id, kind, message))

    def _reply(self, req: ClientRequest, out: StepOutput) -> None:
        """One engine output as one Delta; the last one retires the request."""
        if out.finished:
            self.requests.pop(req.engine_id)
            self.stats.requests_finished += 1
            self.stats.requests_aborted += out.finish_reason == "abort"
        logprobs = None if out.logprobs is None else [TokenLogprobs.from_dict(d) for d in out.logprobs]
        delta = Delta(
            req.request_id,
            out.token_ids,
            out.text,
            out.finish_reason,
            out.stop_reason,
            out.prompt_token_ids,
            logprobs,
            num_prompt_tokens=out.num_prompt_tokens,
        )
        if out.prompt_logprobs is not None:  # the first entry (None) is not sent: the client puts it back
            delta.prompt_logprobs = [PromptTokenLogprobs.from_dict(d) for d in out.prompt_logprobs[1:]]
        self._send(req.identity, delta)

    def _end(self, req: ClientRequest) -> None:
        """Abort a request in the engine and send its last Delta (finish_reason "abort")."""
        tokenizing = self.prompts.cancel(req.engine_id)
        out = self.engine.abort(req.engine_id) if self.healthy and not tokenizing else None
        self._reply(req, out or StepOutput(req.engine_id, [], "", finish_reason="abort"))

    def _abort_all(self, why: str) -> None:
        """The end of a drain: every request still in flight is aborted, with an Aborted error each."""
        if len(self.requests) or len(self.prompts):
            log.info("%s: %d request(s)", why, len(self.requests) + len(self.prompts))
        for req in self.requests.clear():
            if not self.prompts.cancel(req.engine_id):
                self.engine.abort(req.engine_id)  # frees its blocks; its last output is not sent
            self.stats.requests_aborted += 1
            self._send(req.identity, Error(req.request_id, ABORTED, why))
        for job in self.prompts.take_all():  # Tokenize / Detokenize
            identity, msg = job.context
            self._send(identity, Error(msg.request_id, ABORTED, why))

    def _engine_died(self, e: BaseException) -> None:
        self._failed(f"{type(e).__name__}: {e}")
        try:  # stop the surviving workers (frees their devices); bounded by the worker group's own timeout
            self.engine.shutdown()
        except Exception:
            log.exception("error stopping the workers")

    def _failed(self, reason: str) -> None:
        """Every request in flight gets EngineDeadError naming ``reason``; the loop then ends with ``failure``."""
        self.healthy = False
        self.dead_reason = self.failure = reason
        log.error("engine failed, failing %d request(s) and stopping: %s", len(self.requests), reason)
        message = f"the engine is dead: {reason}"
        for req in self.requests.clear():
            self.prompts.cancel(req.engine_id)
            self._send(req.identity, Error(req.request_id, ENGINE_DEAD, message))
        for job in self.prompts.take_all():
            identity, msg = job.context
            self._send(identity, Error(msg.request_id, ENGINE_DEAD, message))

    def _check_clients(self) -> None:
        """Abort the requests of connections silent for the heartbeat timeout (their client died or lost its host),
        and at once those of a local connection that closed."""
        if self.local is not None:
            for identity in self.local.take_gone():
                for req in self.requests.of_connection(identity):
                    self._end(req)
        emptied_at = min(s.emptied_at for s in (self.socket, self.local) if s is not None)
        for identity, silent_s, reqs in self.limits.silent(self.requests, emptied_at):
            log.warning(
                "client %s sent nothing for %.0f s: aborting its %d request(s)",
                identity.hex()[:16],
                silent_s,
                len(reqs),
            )
            self.stats.requests_aborted_client_silent += len(reqs)
            for req in reqs:
                self._end(req)

    def _check_health(self) -> None:
        try:
            self.engine.health()
        except Exception as e:
            self._engine_died(e)
