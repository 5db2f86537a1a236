"""The ZMQ server end to end: ``python launch.py`` in a subprocess, real sockets on loopback, real workers.

Greedy float32 outputs through the server (streaming or not, sync or async client) equal the offline ``LLM``
API's; stop strings that span tokens never leak into streamed text; aborting frees KV blocks; 8 clients x 32
streams complete. The fixtures (a server, the offline API's outputs): conftest.py; malformed frames:
test_client_wire.py; the async and command-line clients: test_async_client.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from client import Client, MessageTooLargeError, OverloadedError, RequestError, SamplingParams
from protocol.client_messages import DEFAULT_MAX_MESSAGE_BYTES
from protocol.codec import encode
from tests.support.server import MAX_MESSAGE_BYTES, MAX_PENDING, generate_frame, some_prompts, wait_stats
from tests.support.timeouts import HANG_S, bound

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# ---- parity ------------------------------------------------------------------------------------------------


def test_stream_equals_generate_equals_offline(server, offline):
    prompts = some_prompts(6)
    offline.prefetch(prompts)
    with Client(server.address, timeout=HANG_S) as c:
        for prompt in prompts:
            ids, text = offline(prompt, GREEDY.max_tokens)
            comp = c.generate(prompt, GREEDY)
            assert comp.token_ids == ids
            assert comp.text == text
            assert comp.finish_reason == "length"
            (ref,) = offline.generate([prompt], GREEDY, False)
            assert comp.prompt_token_ids == ref.prompt_token_ids
            deltas = list(c.stream(prompt, GREEDY))
            assert [t for d in deltas for t in d.token_ids] == ids
            assert "".join(d.text for d in deltas) == text
            assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
            # (equal to the whole decode: a multi-byte character was never emitted half, as U+FFFD, mid-stream)
        many = c.generate_many(prompts, GREEDY)
        assert [m.token_ids for m in many] == [offline(p, GREEDY.max_tokens)[0] for p in prompts]


def _stop_across_tokens(tokenizer, ids: list[int]) -> tuple[str, int, int] | None:
    """A 2-character stop string whose first occurrence in the output straddles the boundary between output
    tokens k-1 and k: returns (stop, char index, k)."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    for k in range(2, len(ids) - 1):
        head = tokenizer.decode(ids[:k], skip_special_tokens=True)
        b = len(head)
        if not full.startswith(head) or b < 1 or b + 1 > len(full):
            continue
        stop = full[b - 1 : b + 1]
        if tokenizer.decode(ids[: k + 1], skip_special_tokens=True).endswith("\ufffd"):
            continue  # the detokenizer would hold token k's text back a step
        if all(ch.isascii() and ch.isprintable() for ch in stop) and full.find(stop) == b - 1:
            return stop, b - 1, k
    return None


def test_stop_string_spanning_tokens(server, offline):
    found = None
    offline.prefetch(some_prompts(16, seed=11))
    for prompt in some_prompts(16, seed=11):
        ids, text = offline(prompt, 40)
        hit = _stop_across_tokens(offline.tokenizer, ids)
        if hit:
            found = prompt, ids, text, hit
            break
    assert found, "no output of the tiny model has a 2-character stop string across a token boundary"
    prompt, ids, text, (stop, idx, k) = found
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"])
    with Client(server.address, timeout=HANG_S) as c:
        comp = c.generate(prompt, params)
        assert comp.text == text[:idx]
        assert comp.finish_reason == "stop" and comp.stop_reason == stop
        assert comp.token_ids == ids[: k + 1]  # the token that completed the stop string ends it
        deltas = list(c.stream(prompt, params))
        streamed = "".join(d.text for d in deltas)
        assert streamed == text[:idx]  # the stop string's first character, already decoded, was held back
        assert [t for d in deltas for t in d.token_ids] == ids[: k + 1]
        assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
        # stop token ids end the request too
        tok = ids[5]
        j = ids.index(tok)
        comp = c.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[tok]))
        assert comp.finish_reason == "stop" and comp.stop_reason == tok and comp.token_ids == ids[: j + 1]
        # ...but not before min_tokens: until then it is masked (vLLM), so greedy takes the next best token
        comp = c.generate(prompt, SamplingParams(temperature=0, max_tokens=40, min_tokens=40, stop_token_ids=[tok]))
        assert comp.finish_reason == "length" and len(comp.token_ids) == 40
        assert comp.token_ids[:j] == ids[:j] and tok not in comp.token_ids


def test_logprobs_and_penalties(server, offline):
    """Penalties, min_tokens and logprobs through the server (generate and stream) equal the offline API's."""
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logprobs=3, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.3, min_tokens=4, stop_token_ids=[5],
    )  # fmt: skip
    prompts = some_prompts(4, seed=5)
    expected = offline.generate(prompts, params, False)
    with Client(server.address, timeout=HANG_S) as c:
        for prompt, ref in zip(prompts, expected):
            assert len(ref.logprobs) == len(ref.token_ids) > 0
            comp = c.generate(prompt, params)
            assert comp.token_ids == ref.token_ids and comp.text == ref.text
            deltas = list(c.stream(prompt, params))
            assert all(d.logprobs is not None and len(d.logprobs) == len(d.token_ids) for d in deltas)
            streamed = [t.as_dict() for d in deltas for t in d.logprobs]
            ref_values = [e.logprob for x in ref.logprobs for e in x.values()]  # the offline API's: vLLM's Logprobs
            for got in (comp.logprobs, streamed):
                assert [list(x) for x in got] == [list(x) for x in ref.logprobs]
                assert np.allclose([v for x in got for v in x.values()], ref_values)
        plain = c.generate(prompts[0], GREEDY)
        assert plain.logprobs is None and plain.token_ids[:16] != expected[0].token_ids


# ---- abort ---------------------------------------------------------------------------------------------------


def test_abort_frees_kv_blocks(server):
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    with Client(server.address, timeout=HANG_S) as c:
        idle = wait_stats(c, lambda s: s["pending"] == 0)
        total = idle["kv_blocks_total"]
        assert idle["kv_blocks_free"] == total
        # leaving a stream early aborts it
        stream = c.stream(list(range(10, 50)), long)
        for _, d in zip(range(3), stream):
            assert d.finish_reason is None
        busy = c.stats()
        assert busy["running"] == 1 and busy["kv_blocks_free"] < total and busy["kv_usage"] > 0
        stream.close()
        after = wait_stats(c, lambda s: s["pending"] == 0 and s["kv_blocks_free"] == total)
        assert after["kv_blocks_free"] == total and after["running"] == 0 and after["waiting"] == 0
        assert after["requests_aborted"] == idle["requests_aborted"] + 1
        # an explicit abort ends the stream with finish_reason "abort"
        stream = c.stream(list(range(60, 100)), long)
        first = next(stream)
        c.abort(stream.request_id)
        rest = list(stream)
        assert rest[-1].finish_reason == "abort"
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 900
        assert stream.completion.finish_reason == "abort"
        after = wait_stats(c, lambda s: s["pending"] == 0 and s["kv_blocks_free"] == total)
        assert after["kv_blocks_free"] == total
        # a client-side timeout aborts too
    with Client(server.address, timeout=0.05) as c:
        with pytest.raises(TimeoutError):
            c.generate(list(range(10, 50)), SamplingParams(max_tokens=900, ignore_eos=True))
    with Client(server.address, timeout=HANG_S) as c:
        after = wait_stats(c, lambda s: s["pending"] == 0 and s["kv_blocks_free"] == total)
        assert after["pending"] == 0 and after["kv_blocks_free"] == total


# ---- validation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, kwargs, field",
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1, 2, 10_000], {}, "vocabulary"),
        ("hi", {"max_tokens": 1030}, "max_tokens"),
        ([i % 500 for i in range(1020)], {"max_tokens": 16}, "max_model_len"),
        ("hi", {"stop_token_ids": [600]}, "stop_token_ids"),
    ],
)
def test_request_errors_name_the_field(server, prompt, kwargs, field):
    with Client(server.address, timeout=HANG_S) as c:
        with pytest.raises(RequestError, match=field):
            c.generate(prompt, SamplingParams(**kwargs))
        with pytest.raises(RequestError, match=field):
            list(c.stream(prompt, SamplingParams(**kwargs)))


def test_overloaded(server):
    with Client(server.address, timeout=HANG_S) as c:
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        streams = [c.stream([7] * 8, params) for _ in range(MAX_PENDING + 20)]
        # handled after every Generate above (one connection is FIFO): their replies are queued by now
        assert c.stats()["pending"] == MAX_PENDING
        for s in streams[MAX_PENDING:]:
            with pytest.raises(OverloadedError, match="overloaded"):
                next(s)
        for s in streams:
            s.close()
        s = wait_stats(c, lambda s: s["pending"] == 0)
        assert s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


def test_request_over_the_message_limit_is_refused_before_sending(server, offline):
    """ZMQ would drop a frame over --max-message-bytes and disconnect the client, failing its other requests:
    the client learns the limit from Info and refuses such a request itself; the connection serves on."""
    big = "a " * (MAX_MESSAGE_BYTES // 2 + 64)  # just over the limit once encoded
    with Client(server.address, timeout=HANG_S) as c:
        assert c.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES  # until the server says
        stream = c.stream(list(range(5, 30)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        first = next(stream)
        assert c.info()["max_message_bytes"] == MAX_MESSAGE_BYTES == c.max_message_bytes
        with pytest.raises(MessageTooLargeError, match=f"prompt: .* limit of {MAX_MESSAGE_BYTES} bytes") as e:
            c.generate(big)
        assert e.value.limit == MAX_MESSAGE_BYTES < e.value.size and isinstance(e.value, RequestError)
        with pytest.raises(MessageTooLargeError, match="params: "):
            c.generate("x", SamplingParams(stop=["b" * MAX_MESSAGE_BYTES]))
        with pytest.raises(MessageTooLargeError):  # the first prompt, already sent, is aborted
            c.generate_many(["hello", big], SamplingParams(max_tokens=500, ignore_eos=True))
        rest = list(stream)  # the stream in flight goes on to its end
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 200
        ids, text = offline("hello", 8)
        assert c.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)).token_ids == ids
        assert wait_stats(c, lambda s: s["pending"] == 0)["pending"] == 0


# ---- concurrency ----------------------------------------------------------------------------------------------


def test_8_clients_x_32_streams(server, offline):
    prompts = some_prompts(16, seed=5)
    lengths = [1, 3, 8, 17, 30, 48]
    jobs = [[(prompts[(c * 7 + i) % 16], lengths[(c + i) % len(lengths)]) for i in range(32)] for c in range(8)]
    offline.prefetch(prompts)
    expected = {}
    for job in jobs:
        for prompt, n in job:
            key = (prompt if isinstance(prompt, str) else tuple(prompt), n)
            expected[key] = offline(prompt, n)
    results: list = [None] * 8
    errors: list = []

    def run(i: int) -> None:
        try:
            with Client(server.address, timeout=HANG_S) as c:
                streams = [
                    c.stream(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in jobs[i]
                ]
                out = []
                for s in reversed(streams):  # read out of order: the others' deltas queue up meanwhile
                    deltas = list(s)
                    out.append(([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas))
                results[i] = out[::-1]
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(bound(600))  # each reply is bounded by the clients' timeout; this stops only a hang
    assert not errors, errors
    assert all(r is not None for r in results)
    for job, res in zip(jobs, results):
        for (prompt, n), (ids, text, deltas) in zip(job, res):
            key = (prompt if isinstance(prompt, str) else tuple(prompt), n)
            assert ids == expected[key][0]
            assert text == expected[key][1]
            assert deltas[-1].finish_reason == "length"
    print(f"8 x 32 streams in {time.monotonic() - t0:.1f} s")
    with Client(server.address, timeout=HANG_S) as c:
        s = wait_stats(c, lambda s: s["pending"] == 0)
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
        assert s["prefix_cache_hit_tokens"] > 0 and 0 < s["prefix_cache_hit_rate"] <= 1


def test_slow_and_vanished_clients_do_not_stall(server, offline):
    ctx = zmq.Context()
    slow = ctx.socket(zmq.DEALER)  # sends streaming requests and never reads a reply
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.LINGER, 0)
    slow.connect(server.address)
    gone = ctx.socket(zmq.DEALER)  # sends streaming requests and disconnects
    gone.setsockopt(zmq.LINGER, 2000)
    gone.connect(server.address)
    try:
        for i in range(32):
            slow.send(
                encode(generate_frame(f"s{i}", prompt=[5 + i] * 10, stream=True, max_tokens=100, ignore_eos=True))
            )
            gone.send(
                encode(generate_frame(f"g{i}", prompt=[9 + i] * 10, stream=True, max_tokens=100, ignore_eos=True))
            )
        gone.close()  # lingers until its requests are out, then vanishes
        ids, text = offline("hello", 8)
        with Client(server.address, timeout=HANG_S) as c:
            assert wait_stats(c, lambda s: s["pending"] > 0)["pending"] > 0
            comp = c.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            assert comp.token_ids == ids and comp.text == text
            # their requests run to completion (or until aborted); nothing is stuck
            s = wait_stats(c, lambda s: s["pending"] == 0)
            assert s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
    finally:
        slow.close()
        ctx.term()
    assert server.proc.poll() is None


def test_tokenize_with_token_strings(server, offline):
    text = "Hello world"
    with Client(server.address, timeout=HANG_S) as c:
        ids, strs = c.token_strings(text)
        assert ids == c.tokenize(text) == offline.tokenizer.encode(text)
    assert strs == offline.tokenizer.convert_ids_to_tokens(ids)
    assert any(s.startswith("Ġ") for s in strs)  # the vocabulary's spelling of " world", not its text
