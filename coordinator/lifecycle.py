"""When the server's loop ends, and what the requests still in flight are told then.

- ``stop()`` (SIGTERM/SIGINT) starts a drain: new Generates are refused (Aborted: "shutting down"), the requests in
  flight run to their end for up to ``shutdown_timeout_s``, and the rest are then aborted, each with an Aborted
  error (not a Delta with finish_reason "abort", which a non-streamed HTTP client took for a 200). A second
  ``stop()`` ends the drain at once; a timeout of 0 never drains.
- ``fail(reason)`` (any thread: the launcher calls it when the HTTP front-end dies) and an engine failure end the
  loop at once: the requests in flight get EngineDeadError with the reason, and ``failure`` tells the launcher to
  exit non-zero, so a supervisor restarts the service instead of watching it stay up unhealthy.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("nanoserve.server")

# vLLM's --shutdown-timeout defaults to 0 (abort at once); a drain is what issue 54 asks for, and 25 s lets it end,
# aborts and cleanup included, inside Kubernetes' default 30 s grace period before its SIGKILL
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0


class Lifecycle:
    """The loop's end: a drain after ``stop()``, at once after a second ``stop()`` or ``fail()``. Both only set
    fields (safe from a signal handler and from another thread); the loop reads them every turn (``done``)."""

    def __init__(self, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        if not shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0 (0 = abort at once), got {shutdown_timeout_s}")
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stops = 0
        self.fail_reason: str | None = None
        self._deadline: float | None = None

    def stop(self) -> None:
        self.stops += 1

    def fail(self, reason: str) -> None:
        if self.fail_reason is None:  # the first cause is the one reported
            self.fail_reason = reason

    @property
    def draining(self) -> bool:
        return self.stops > 0

    def done(self, in_flight: int) -> bool:
        """Whether the loop ends now, with ``in_flight`` requests (and tokenizer jobs) left."""
        if self.fail_reason is not None:
            return True
        if not self.stops:
            return False
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.shutdown_timeout_s
            if in_flight and self.shutdown_timeout_s:
                log.info(
                    "shutting down: letting %d request(s) finish for up to %g s (a second signal aborts them now)",
                    in_flight,
                    self.shutdown_timeout_s,
                )
        return self.stops > 1 or not in_flight or now >= self._deadline

    def abort_message(self) -> str:
        """What a request still in flight at the end is told."""
        if self.stops > 1 or not self.shutdown_timeout_s:
            return "the server is shutting down: request aborted"
        return f"the server is shutting down: request aborted, still running after {self.shutdown_timeout_s:g} s"
