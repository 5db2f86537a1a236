"""The client endpoint's wire format, by hand: 1,200 malformed, oversized and half-valid frames each get an error
naming the problem (or have their connection dropped) and leave the server up and answering as before; a raw
msgpack health message gets its reply."""

from __future__ import annotations

import math
import random
import time
from dataclasses import fields

import msgpack
import pytest
import zmq

from client import Client, SamplingParams
from protocol.client_messages import CLIENT_PROTOCOL_VERSION, Abort, Error, Health
from protocol.codec import ProtocolError, decode, encode
from tests.support.server import MAX_MESSAGE_BYTES, generate_frame, wait_stats
from tests.support.timeouts import HANG_S

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


PARAM_NAMES = [f.name for f in fields(SamplingParams)]

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
    ({"seed": 2**63}, "seed"),  # past int64 (negative ones are vLLM's too)
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
                frame = encode(generate_frame(rid, **overrides))
                expect_error[rid] = field
            elif kind == 6:  # unknown (extra) or missing fields, in the request or in its params record
                raw = msgpack.unpackb(encode(generate_frame(rid)), raw=False)
                if rng.random() < 0.5:  # params travel as a map of their non-default fields (the sparse record)
                    raw[6][1].update({f"x{j}": _random_value(rng) for j in range(rng.randint(1, 3))})
                    expect_error[rid] = "unknown field"
                else:
                    if rng.random() < 0.5:
                        raw += [_random_value(rng) for _ in range(3)]
                    else:  # the request keeps its tag, version, request_id and token: the error can name it
                        del raw[len(raw) - rng.randint(1, len(raw) - 4) :]
                    expect_error[rid] = "fields"
                frame = msgpack.packb(raw, use_bin_type=True)
            elif kind == 7:  # a valid Generate with one field (or one of its params) replaced by random garbage
                raw = msgpack.unpackb(encode(generate_frame(rid)), raw=False)
                if rng.random() < 0.5:
                    raw[rng.randint(4, len(raw) - 1)] = _random_value(rng)
                else:
                    raw[6][1][rng.choice(PARAM_NAMES)] = _random_value(rng)
                frame = msgpack.packb(raw, use_bin_type=True)
            elif kind == 8:  # control messages with odd ids (including unknown aborts)
                frame = encode(Abort(CLIENT_PROTOCOL_VERSION, rng.choice(["", "nope", "x" * 300, rid]), None))
            elif kind == 9:  # multipart frames
                sock.send_multipart([rng.randbytes(8) for _ in range(rng.randint(2, 4))])
                sent += 1
                continue
            elif kind == 10:  # truncated valid frames
                data = encode(generate_frame(rid))
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
        deadline = time.monotonic() + HANG_S
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
    with Client(server.address, timeout=HANG_S) as c:
        assert c.health()["healthy"]
        comp = c.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert comp.token_ids == ids and comp.text == text
        stats = wait_stats(c, lambda s: s["pending"] == 0)
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
