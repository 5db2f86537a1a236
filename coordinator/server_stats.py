"""The client endpoint's own counters (requests finished, aborted and rejected, per-client refusals and aborts of
silent clients; frames and replies dropped), the output tokens per second over its last few seconds of steps, and
the ``StatsReply`` that joins them to the engine's stats."""

from __future__ import annotations

import collections
import time

from protocol.client_messages import StatsReply

RATE_WINDOW_S = 5.0


class ServerStats:
    def __init__(self) -> None:
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_rejected = 0
        self.requests_rejected_per_client = 0  # of requests_rejected: the client was at its own limit
        self.requests_aborted_client_silent = 0  # of requests_aborted: their connection fell silent
        self.frames_dropped = 0
        self.replies_dropped = 0
        self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self._output_tokens = 0
        self._started = time.monotonic()

    def start(self, output_tokens: int) -> None:
        """The loop starts, the engine having produced ``output_tokens`` so far."""
        self._output_tokens = output_tokens
        self._started = time.monotonic()

    def step(self, output_tokens: int) -> None:
        """A step ended with the engine's total of ``output_tokens``."""
        now = time.monotonic()
        self._rate.append((now, output_tokens - self._output_tokens))
        self._output_tokens = output_tokens
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
            self._rate.popleft()

    def reply(self, rid: str, s: dict, healthy: bool, pending: int, clients: int = 0) -> StatsReply:
        """The Stats answer from the engine's ``stats()`` dict ``s`` and this endpoint's state."""
        now = time.monotonic()
        window = min(RATE_WINDOW_S, max(now - self._started, 1e-3))
        recent = sum(n for t, n in self._rate if t >= now - window)
        hits, computed = s["prefix_cache_hit_tokens"], s["prompt_tokens"]
        total, free = s["kv_blocks_total"], s["kv_blocks_free"]
        return StatsReply(
            request_id=rid,
            healthy=healthy,
            running=s["running"],
            waiting=s["waiting"],
            pending=pending,
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
            clients_pending=clients,
            requests_rejected_per_client=self.requests_rejected_per_client,
            requests_aborted_client_silent=self.requests_aborted_client_silent,
            spec_decode_num_drafts=s.get("spec_decode_num_drafts", 0),
            spec_decode_num_draft_tokens=s.get("spec_decode_num_draft_tokens", 0),
            spec_decode_num_accepted_tokens=s.get("spec_decode_num_accepted_tokens", 0),
            spec_decode_num_accepted_tokens_per_pos=s.get("spec_decode_num_accepted_tokens_per_pos"),
        )
