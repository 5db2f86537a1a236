"""Tokenization off the step loop: while one client's 7 MB chat (no max_tokens) and 7 MB /tokenize are tokenized,
another client's stream keeps its pace and Health answers at once. The real Server and Engine (tiny CPU model)
in this process, the real Client over ZMQ.

The tiny model's context (1024 tokens) refuses a 7 MB text by its length before tokenizing; a model with a long
context (Qwen3: 40,960 tokens, long merged tokens) takes such a text to the tokenizer. The test raises the engine's
character limits to what such a model has, so the texts are really tokenized (seconds of work on this machine)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time

import pytest

from client import Client, SamplingParams
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.server import Server
from tests.support.processes import ROOT
from tests.support.server import ENGINE_KWARGS, wait_stats

BIG = 7_000_000  # characters, as in issue 54
STREAM = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tiny_tied):
    engine = Engine(EngineConfig(model=str(tiny_tied), **ENGINE_KWARGS))
    # the limits of a long-context model (see the module's docstring)
    engine.admission.max_prompt_chars = engine.admission.max_tokenize_chars = 4 * BIG
    server = Server("127.0.0.1", 0, max_message_bytes=4 * BIG)
    thread = threading.Thread(target=server.serve, args=(engine,), daemon=True)
    thread.start()
    yield server
    server.stop()
    server.stop()  # a second stop: abort at once
    thread.join(60)
    engine.shutdown()
    server.close(0)


# the big requests, from a process of their own as a real client's (in this one, their encoding and the decoding
# of 6M token ids would hold the server's GIL): prints what each got
BIG_CLIENT = """
import json, sys, threading
from client import Client
size = int(sys.argv[2])
text = ("the quick brown fox jumps over the lazy dog, \u00dcn\u00efc\u00f6d\u00e9 " * (size // 50 + 1))[:size]
out = {}
def big(name, call):
    with Client(sys.argv[1], timeout=300) as c:
        try:
            out[name] = len(call(c))
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
calls = {"tokenize": lambda c: c.tokenize(text), "chat": lambda c: c.chat([{"role": "user", "content": text}])}
threads = [threading.Thread(target=big, args=item) for item in calls.items()]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


def test_a_big_tokenization_does_not_stall_other_streams(served):
    with Client(served.address, timeout=300) as c:
        arrivals = []
        stream = c.stream(list(range(10, 40)), STREAM)
        arrivals.append(time.monotonic())
        next(stream)
        for _ in range(20):  # the stream's own pace, before the big requests
            next(stream)
            arrivals.append(time.monotonic())

        big = subprocess.Popen(
            [sys.executable, "-c", BIG_CLIENT, served.address, str(BIG)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        t_big = time.monotonic()
        health_latency = []
        for delta in stream:
            arrivals.append(time.monotonic())
            if len(arrivals) % 20 == 0:
                t0 = time.monotonic()
                assert c.health()["healthy"]
                health_latency.append(time.monotonic() - t0)
            if delta.finish_reason is not None or big.poll() is not None:
                break
        busy = big.poll() is None  # the stream ended first: the big requests still ran throughout
        printed, errors = big.communicate(timeout=600)
        assert big.returncode == 0, errors
        outcome = json.loads(printed)
        stream.close()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    before = statistics.median(gaps[:20])
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > t_big]
    print(f"median gap {before * 1e3:.1f} ms, max during {max(during) * 1e3:.0f} ms over {len(during)} gaps; "
          f"health max {max(health_latency, default=0) * 1e3:.0f} ms; big requests still running: {busy}")  # fmt: skip
    assert len(during) >= 20, "the stream got no tokens while the big requests ran"
    # generous for a loaded 2-core box (what is left: the GIL held while 6M ids become a list and are packed, 0.3 s on
    # an idle host, seconds at a load of 16); tokenized on the loop, one gap was the whole encode (17-74 s)
    stall_bound = max(25 * before, 6.0)  # relative to this host's own pace: a loaded host slows both
    assert max(during) < stall_bound, (max(during), before)
    assert health_latency and max(health_latency) < stall_bound, (health_latency, before)
    assert isinstance(outcome["tokenize"], int) and outcome["tokenize"] > BIG // 4, outcome
    assert outcome["chat"].startswith("RequestError") and "max_model_len" in outcome["chat"], outcome


def test_a_request_being_tokenized_is_pending_and_abortable(served):
    with Client(served.address, timeout=120) as c:
        stream = c.stream("a " * (BIG // 2), SamplingParams(max_tokens=4))
        s = wait_stats(c, lambda s: s["pending"] == 1, timeout=60)
        assert s["pending"] == 1 and s["running"] == s["waiting"] == 0, s  # counted while on a tokenizer thread
        t0 = time.monotonic()
        stream.close()  # aborts it: answered at once, not when its encode ends (tens of seconds here)
        assert wait_stats(c, lambda s: s["pending"] == 0, timeout=60)["pending"] == 0
        aborted_in = time.monotonic() - t0
        # the server goes on serving meanwhile; the encode's result, when it comes, is dropped
        assert c.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3)).finish_reason == "length"
        assert len(served.requests) == 0
        print(f"aborted in {aborted_in * 1e3:.0f} ms while tokenizing")
