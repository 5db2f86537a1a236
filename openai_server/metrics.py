"""Prometheus metrics under vLLM's names with a ``nanoserve:`` prefix, so dashboards port by a prefix swap.

Engine-wide numbers (requests running and waiting, KV cache usage, prefix-cache queries and hits, prompt and
generation tokens, preemptions) come from the coordinator's Stats at each scrape, so they count every client.
Latency histograms (time to first token, inter-token latency: streaming requests; end-to-end: every request)
and per-request token histograms are measured here, for the HTTP requests this front-end serves.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("nanoserve.http")
PREFIX = "nanoserve:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _EngineCollector:
    """The coordinator's Stats as gauges and counters (its totals are counters already)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict | None = None

    def collect(self):
        s, labels = self.stats, [self.model_name]
        if s is None:
            return
        hits, computed = s["prefix_cache_hit_tokens"], s["prompt_tokens"]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s["running"]),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"]),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s["kv_usage"]),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens processed (computed + prefix-cache hits).", computed + hits),
            ("generation_tokens", "Tokens generated.", s["output_tokens"]),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", computed + hits),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits),
            ("num_preemptions", "Sequences preempted (their KV recomputed later).", s["preemptions"]),
        ):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c
        yield from _spec_decode(s, labels)


def _spec_decode(s: dict, labels: list[str]):
    """vLLM's speculative-decoding counters, when speculation is on (the per-position list is set)."""
    per_pos = s.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos is None:
        return
    for name, doc in (
        ("spec_decode_num_drafts", "Verify rows: sequences given drafts in a step."),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ):
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric(labels, s[name])
        yield c
    c = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft.",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(per_pos):
        c.add_metric([*labels, str(position)], value)
    yield c


class Metrics:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series beside every counter and histogram (vLLM turns them off too)
        self.registry = reg = CollectorRegistry()
        lab = ["model_name"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token (streaming).", lab, registry=reg,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between output tokens (streaming).", lab, registry=reg,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token.", lab, registry=reg,
            buckets=_E2E_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.prompt_len = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt tokens per request.", lab, registry=reg, buckets=_TOKEN_BUCKETS
        ).labels(model_name)
        self.gen_len = Histogram(
            PREFIX + "request_generation_tokens", "Generated tokens per request.", lab, registry=reg,
            buckets=_TOKEN_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self._success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", [*lab, "finished_reason"], registry=reg
        )
        self.model_name = model_name
        self.engine = _EngineCollector(model_name)
        reg.register(self.engine)

    def finished(self, request_id: str, arrival: float, prompt_tokens: int, output_tokens: int, reasons) -> None:
        """One HTTP request done (``reasons``: its choices' finish reasons): its histograms and its log line."""
        latency = time.monotonic() - arrival
        self.e2e.observe(latency)
        self.prompt_len.observe(prompt_tokens)
        self.gen_len.observe(output_tokens)
        for r in reasons:
            self._success.labels(self.model_name, r).inc()
        log.info(
            "%s finished: %d prompt + %d output tokens, %.3f s, finish_reason=%s",
            request_id, prompt_tokens, output_tokens, latency, ",".join(dict.fromkeys(reasons)),
        )  # fmt: skip

    def render(self, stats: dict | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)


class TokenTimer:
    """One streaming choice's time to first token and inter-token latencies."""

    __slots__ = ("metrics", "last", "started")

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self.metrics, self.last, self.started = metrics, arrival, False

    def tokens(self, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        if self.started:
            self.metrics.itl.observe((now - self.last) / n)
        else:
            self.metrics.ttft.observe(now - self.last)
            self.started = True
        self.last = now
