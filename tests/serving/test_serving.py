"""The ZMQ server end to end: ``python launch.py`` in a subprocess, real sockets on loopback, real workers.

Greedy float32 outputs through the server (streaming or not, sync or async client) equal the offline ``LLM``
API's; stop strings that span tokens never leak into streamed text; aborting frees KV blocks; 8 clients x 32
streams complete; 1,000+ malformed frames leave the server up and answering."""

from __future__ import annotations

import asyncio
import math
import os
import random
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from client import AsyncClient, Client, EngineDeadError, OverloadedError, RequestError, SamplingParams
from protocol.client_messages import CLIENT_PROTOCOL_VERSION, Abort, Error, Generate, Health
from protocol.codec import ProtocolError, decode, encode
from tests.support.processes import ROOT
from tests.support.server import ENGINE_KWARGS, ServerProcess

MAX_PENDING = 300
MAX_MESSAGE_BYTES = 1 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    srv = ServerProcess(
        tiny_tied,
        tmp_path_factory.mktemp("server") / "server.log",
        "--max-pending-requests", str(MAX_PENDING), "--max-message-bytes", str(MAX_MESSAGE_BYTES),
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_tied):
    """Greedy outputs of the offline API, computed once per prompt with a long budget (shorter requests
    are prefixes of these: ignore_eos, greedy)."""
    from client import LLM

    with LLM(str(tiny_tied), **ENGINE_KWARGS) as llm:
        cache: dict = {}

        def expect(prompt, max_tokens: int = 48):
            key = prompt if isinstance(prompt, str) else tuple(prompt)
            if key not in cache:
                (c,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), False)
                cache[key] = c
            c = cache[key]
            return c.token_ids[:max_tokens], llm.tokenizer.decode(c.token_ids[:max_tokens], skip_special_tokens=True)

        expect.llm = llm
        expect.tokenizer = llm.tokenizer
        expect.generate = llm.generate
        yield expect


def some_prompts(n: int = 16, seed: int = 3) -> list:
    rng = np.random.default_rng(seed)
    words = ["def", "class", "return", "import os", "hello", "the quick brown fox", "for i in range(", "Ünïcödé ✓"]
    prompts: list = []
    for i in range(n):
        if i % 2:
            prompts.append(rng.integers(3, 500, int(rng.integers(1, 70))).tolist())
        else:
            prompts.append(" ".join(rng.choice(words, int(rng.integers(1, 8)))))
    return prompts


# ---- parity ------------------------------------------------------------------------------------------------


def test_stream_equals_generate_equals_offline(server, offline):
    prompts = some_prompts(6)
    with Client(server.address, timeout=30) as c:
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
    for prompt in some_prompts(16, seed=11):
        ids, text = offline(prompt, 40)
        hit = _stop_across_tokens(offline.tokenizer, ids)
        if hit:
            found = prompt, ids, text, hit
            break
    assert found, "no output of the tiny model has a 2-character stop string across a token boundary"
    prompt, ids, text, (stop, idx, k) = found
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"])
    with Client(server.address, timeout=30) as c:
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
    with Client(server.address, timeout=30) as c:
        for prompt, ref in zip(prompts, expected):
            assert len(ref.logprobs) == len(ref.token_ids) > 0
            comp = c.generate(prompt, params)
            assert comp.token_ids == ref.token_ids and comp.text == ref.text
            deltas = list(c.stream(prompt, params))
            assert all(d.logprobs is not None and len(d.logprobs) == len(d.token_ids) for d in deltas)
            streamed = [t.as_dict() for d in deltas for t in d.logprobs]
            for got in (comp.logprobs, streamed):
                assert [list(x) for x in got] == [list(x) for x in ref.logprobs]
                assert np.allclose([v for x in got for v in x.values()], [v for x in ref.logprobs for v in x.values()])
        plain = c.generate(prompts[0], GREEDY)
        assert plain.logprobs is None and plain.token_ids[:16] != expected[0].token_ids


# ---- abort ---------------------------------------------------------------------------------------------------


def _wait_stats(c: Client, cond, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = c.stats()
        if cond(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def test_abort_frees_kv_blocks(server):
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    with Client(server.address, timeout=30) as c:
        idle = _wait_stats(c, lambda s: s["pending"] == 0)
        total = idle["kv_blocks_total"]
        assert idle["kv_blocks_free"] == total
        # leaving a stream early aborts it
        stream = c.stream(list(range(10, 50)), long)
        for _, d in zip(range(3), stream):
            assert d.finish_reason is None
        busy = c.stats()
        assert busy["running"] == 1 and busy["kv_blocks_free"] < total and busy["kv_usage"] > 0
        stream.close()
        after = _wait_stats(c, lambda s: s["pending"] == 0 and s["kv_blocks_free"] == total)
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
        after = _wait_stats(c, lambda s: s["pending"] == 0 and s["kv_blocks_free"] == total)
        assert after["kv_blocks_free"] == total
        # a client-side timeout aborts too
    with Client(server.address, timeout=0.05) as c:
        with pytest.raises(TimeoutError):
            c.generate(list(range(10, 50)), SamplingParams(max_tokens=900, ignore_eos=True))
    with Client(server.address, timeout=30) as c:
        after = _wait_stats(c, lambda s: s["pending"] == 0 and s["kv_blocks_free"] == total)
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
    with Client(server.address, timeout=30) as c:
        with pytest.raises(RequestError, match=field):
            c.generate(prompt, SamplingParams(**kwargs))
        with pytest.raises(RequestError, match=field):
            list(c.stream(prompt, SamplingParams(**kwargs)))


def test_overloaded(server):
    with Client(server.address, timeout=30) as c:
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        streams = [c.stream([7] * 8, params) for _ in range(MAX_PENDING + 20)]
        # handled after every Generate above (one connection is FIFO): their replies are queued by now
        assert c.stats()["pending"] == MAX_PENDING
        for s in streams[MAX_PENDING:]:
            with pytest.raises(OverloadedError, match="overloaded"):
                next(s)
        for s in streams:
            s.close()
        s = _wait_stats(c, lambda s: s["pending"] == 0)
        assert s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


# ---- concurrency ----------------------------------------------------------------------------------------------


def test_8_clients_x_32_streams(server, offline):
    prompts = some_prompts(16, seed=5)
    lengths = [1, 3, 8, 17, 30, 48]
    jobs = [[(prompts[(c * 7 + i) % 16], lengths[(c + i) % len(lengths)]) for i in range(32)] for c in range(8)]
    expected = {}
    for job in jobs:
        for prompt, n in job:
            key = (prompt if isinstance(prompt, str) else tuple(prompt), n)
            expected[key] = offline(prompt, n)
    results: list = [None] * 8
    errors: list = []

    def run(i: int) -> None:
        try:
            with Client(server.address, timeout=60) as c:
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
        t.join(120)
    assert not errors, errors
    assert all(r is not None for r in results)
    for job, res in zip(jobs, results):
        for (prompt, n), (ids, text, deltas) in zip(job, res):
            key = (prompt if isinstance(prompt, str) else tuple(prompt), n)
            assert ids == expected[key][0]
            assert text == expected[key][1]
            assert deltas[-1].finish_reason == "length"
    print(f"8 x 32 streams in {time.monotonic() - t0:.1f} s")
    with Client(server.address, timeout=30) as c:
        s = _wait_stats(c, lambda s: s["pending"] == 0)
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
                encode(_valid_generate(f"s{i}", prompt=[5 + i] * 10, stream=True, max_tokens=100, ignore_eos=True))
            )
            gone.send(
                encode(_valid_generate(f"g{i}", prompt=[9 + i] * 10, stream=True, max_tokens=100, ignore_eos=True))
            )
        gone.close()  # lingers until its requests are out, then vanishes
        ids, text = offline("hello", 8)
        with Client(server.address, timeout=30) as c:
            assert _wait_stats(c, lambda s: s["pending"] > 0)["pending"] > 0
            comp = c.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            assert comp.token_ids == ids and comp.text == text
            # their requests run to completion (or until aborted); nothing is stuck
            s = _wait_stats(c, lambda s: s["pending"] == 0, timeout=60)
            assert s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
    finally:
        slow.close()
        ctx.term()
    assert server.proc.poll() is None


# ---- async client ---------------------------------------------------------------------------------------------


def test_async_client(server, offline):
    prompts = some_prompts(8, seed=9)

    async def main():
        async with AsyncClient(server.address) as c:
            assert (await c.health())["healthy"]
            info = await c.info()
            assert info["max_model_len"] == 1024 and info["tensor_parallel_size"] == 1 and info["worker_pids"]
            comps = await asyncio.gather(*(c.generate(p, GREEDY) for p in prompts))
            assert [x.token_ids for x in comps] == [offline(p, GREEDY.max_tokens)[0] for p in prompts]
            many = await c.generate_many(prompts, GREEDY)
            assert [x.token_ids for x in many] == [x.token_ids for x in comps]

            async def collect(p):
                ids, text = [], ""
                async for d in c.stream(p, GREEDY):
                    ids += d.token_ids
                    text += d.text
                return ids, text

            streamed = await asyncio.gather(*(collect(p) for p in prompts))
            assert streamed == [offline(p, GREEDY.max_tokens) for p in prompts]
            with pytest.raises(RequestError, match="max_tokens"):
                await c.generate("x", SamplingParams(max_tokens=2000))
            with pytest.raises(RequestError, match="prompt"):
                await c.generate(3.5)
            # cancelling the task that awaits a request aborts it on the server
            long = SamplingParams(max_tokens=900, ignore_eos=True)
            before = await c.stats()
            task = asyncio.create_task(c.generate(list(range(5, 30)), long))
            while (await c.stats())["running"] == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # and so does leaving a stream early
            stream = c.stream(list(range(5, 30)), long)
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(200):
                s = await c.stats()
                if s["pending"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
            assert s["requests_aborted"] == before["requests_aborted"] + 2

    asyncio.run(asyncio.wait_for(main(), 60))


def test_cli_client_streams_to_terminal(server, offline):
    ids, text = offline("hello world", 16)
    out = subprocess.run(
        [sys.executable, "-m", "client", "--address", server.address, "--temperature", "0", "--max-tokens", "16"]
        + ["--ignore-eos", "hello", "world"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONIOENCODING="utf-8"),
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode("utf-8") == text + "\n"
    assert b"finish_reason=length" in out.stderr


# ---- fuzz -----------------------------------------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "bigint", "float", "str", "bytes", "none", "bool"] + (["list", "dict"] if depth < 3 else [])
    k = rng.choice(kinds)
    if k == "int":
        return rng.randint(-(2**31), 2**31)
    if k == "bigint":
        return rng.choice([2**63 - 1, -(2**63), 2**64 - 1])
    if k == "float":
        return rng.choice([0.5, -1e300, math.inf, -math.inf, math.nan, 1e-320])
    if k == "str":
        return "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 20)))
    if k == "bytes":
        return rng.randbytes(rng.randint(0, 40))
    if k == "none":
        return None
    if k == "bool":
        return rng.random() < 0.5
    if k == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {str(i): _random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}


def _valid_generate(rid: str, **kw) -> Generate:
    """A Generate frame; keyword arguments override its fields or its params' (set after construction, so that
    bad values reach the wire unvalidated)."""
    msg = Generate(CLIENT_PROTOCOL_VERSION, rid, None, "hello", False, SamplingParams(temperature=0.0, max_tokens=4))
    for name, value in kw.items():
        setattr(msg if hasattr(msg, name) and name != "params" else msg.params, name, value)
    return msg


# (field overrides, what the error must mention): each is a well-formed frame with one bad value
BAD_VALUES = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": [-1]}, "vocabulary"),
    ({"prompt": [512]}, "vocabulary"),
    ({"prompt": [2**40]}, "vocabulary"),
    ({"prompt": "x" * 600_000}, "prompt"),
    ({"prompt": list(range(1100))}, "max_model_len"),
    ({"prompt": [i % 500 for i in range(1000)], "max_tokens": 100}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 1e9}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": 10, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [100_000]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"temperature": "hot"}, "temperature"),  # wrong types: rejected by the codec, still attributed
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stream": 1}, "stream"),
    ({"stop": "x"}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"protocol_version": 99}, "protocol_version"),
]


def test_fuzz_client_endpoint(server, offline):
    rng = random.Random(20240611)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(server.address)
    big = ctx.socket(zmq.DEALER)  # frames over --max-message-bytes get their connection dropped: own socket
    big.setsockopt(zmq.LINGER, 0)
    big.connect(server.address)
    expect_error: dict[str, str] = {}  # request id -> what the error message must mention
    sent = 0
    try:
        for i in range(1200):
            rid = f"fz{i}"
            kind = i % 12
            if kind == 0:
                frame = rng.randbytes(rng.randint(0, 2000))
            elif kind == 1:
                frame = msgpack.packb(_random_value(rng), use_bin_type=True)
            elif kind == 2:  # a known or unknown tag with random fields
                frame = msgpack.packb(
                    [rng.choice([20, 21, 22, 23, 24, 30, 31, 1, 7, 99, -1])]
                    + [_random_value(rng) for _ in range(rng.randint(0, 22))],
                    use_bin_type=True,
                )
            elif kind in (3, 4, 5):  # one bad value in an otherwise valid Generate: an error naming it
                overrides, field = BAD_VALUES[(i // 12 * 3 + kind - 3) % len(BAD_VALUES)]
                frame = encode(_valid_generate(rid, **overrides))
                expect_error[rid] = field
            elif kind == 6:  # unknown (extra) or missing fields, in the request or in its params record
                raw = msgpack.unpackb(encode(_valid_generate(rid)), raw=False)
                where = raw if rng.random() < 0.5 else raw[-1]
                if rng.random() < 0.5:
                    where += [_random_value(rng) for _ in range(3)]
                else:  # the request keeps its tag, version, request_id and token: the error can name it
                    del where[len(where) - rng.randint(1, min(len(where) - 4, 15)) :]
                frame = msgpack.packb(raw, use_bin_type=True)
                expect_error[rid] = "fields"
            elif kind == 7:  # a valid Generate with one field (or one of its params) replaced by random garbage
                raw = msgpack.unpackb(encode(_valid_generate(rid)), raw=False)
                where = raw if rng.random() < 0.5 else raw[-1]
                j = rng.randint(4 if where is raw else 1, len(where) - 1)
                where[j] = _random_value(rng)
                frame = msgpack.packb(raw, use_bin_type=True)
            elif kind == 8:  # control messages with odd ids (including unknown aborts)
                frame = encode(Abort(CLIENT_PROTOCOL_VERSION, rng.choice(["", "nope", "x" * 300, rid]), None))
            elif kind == 9:  # multipart frames
                sock.send_multipart([rng.randbytes(8) for _ in range(rng.randint(2, 4))])
                sent += 1
                continue
            elif kind == 10:  # truncated valid frames
                data = encode(_valid_generate(rid))
                frame = data[: rng.randint(0, len(data) - 1)]
            else:  # a reply record sent to the server, or a wrong-version frame with a bad id
                wrong_version = msgpack.packb([20, CLIENT_PROTOCOL_VERSION + 1, 123, None], use_bin_type=True)
                frame = rng.choice([encode(Error(rid, "x", "y")), wrong_version, b"\x91" * 5000])
            sock.send(frame)
            sent += 1
        for _ in range(3):  # oversized
            big.send(b"\x00" * (MAX_MESSAGE_BYTES + 1024))
        assert sent >= 1000

        # every attributable bad request got an error that names the problem
        got: dict[str, Error] = {}
        deadline = time.monotonic() + 60
        while set(expect_error) - set(got) and time.monotonic() < deadline:
            if sock.poll(200):
                msg = decode(sock.recv())
                if isinstance(msg, Error) and msg.request_id in expect_error:
                    got[msg.request_id] = msg
        missing = sorted(set(expect_error) - set(got))
        assert not missing, f"no error reply for {missing[:10]}"
        for rid, field in expect_error.items():
            assert field in got[rid].message, (rid, field, got[rid])
            assert got[rid].kind in ("RequestError", "Protocol")
    finally:
        sock.close()
        big.close()
        ctx.term()

    assert server.proc.poll() is None, server.stderr()
    ids, text = offline("hello", 8)
    with Client(server.address, timeout=30) as c:
        assert c.health()["healthy"]
        comp = c.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert comp.token_ids == ids and comp.text == text
        stats = _wait_stats(c, lambda s: s["pending"] == 0)
        assert stats["frames_dropped"] > 100 and stats["requests_rejected"] > 100
    assert server.proc.poll() is None


def test_health_message_raw(server):
    """The wire format by hand: a DEALER, one msgpack frame, replies matched by request id."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.address)
        sock.send(encode(Health(CLIENT_PROTOCOL_VERSION, "h1", None)))
        assert sock.poll(10_000)
        reply = decode(sock.recv())
        assert reply.request_id == "h1" and reply.healthy
        with pytest.raises(ProtocolError):
            decode(b"\xc1")
    finally:
        sock.close()
        ctx.term()


def test_errors_are_exceptions():
    assert issubclass(EngineDeadError, RuntimeError) and issubclass(RequestError, ValueError)
