"""protocol/codec.py + protocol/messages.py: every registered message round-trips, arrays travel as packed
little-endian bytes, malformed frames raise ProtocolError and nothing else; the decode step stays small. The
worker handshake over a real socket: test_worker_handshake.py."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import msgpack
import numpy as np
import pytest

import protocol
import protocol.messages
from protocol import records
from protocol.codec import ProtocolError, decode, encode
from protocol.messages import PROTOCOL_VERSION, Shutdown, StepCommand, StepMasks, StepResult, WorkerHello
from protocol.sampling_params import SamplingParams
from tests.support.builders import make_step

ARRAY_DTYPES = {"I32": "<i4", "I64": "<i8", "F32": "<f4"}
SCALAR_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "bytes": bytes}

# every module of the protocol package, so that every registered message type is covered below
PROTOCOL_MODULES = [importlib.import_module(f"protocol.{m.name}") for m in pkgutil.iter_modules(protocol.__path__)]
REGISTRY = sorted(records.BY_TAG.items())
STEP_FIELDS = [f.name for f in dataclasses.fields(StepCommand)]


def test_registry_covers_every_message_class():
    """Every dataclass of a module that defines messages is registered (else it could never be sent)."""
    registered = {cls for _, cls in REGISTRY}
    assert protocol.messages.StepCommand in registered and protocol.messages.WorkerHello in registered
    for mod in PROTOCOL_MODULES:
        classes = {
            v
            for v in vars(mod).values()
            if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == mod.__name__
        }
        if classes & registered:
            assert classes <= registered, (
                f"{mod.__name__}: unregistered {sorted(c.__name__ for c in classes - registered)}"
            )
    assert records.TAG_OF == {cls: tag for tag, cls in REGISTRY}


# ---- random instances from annotations -----------------------------------------------------------------


def random_value(ann: str, rng: np.random.Generator, depth: int = 0):
    ann = ann.replace(" ", "")
    if ann.endswith("|None"):
        return None if rng.random() < 0.3 else random_value(ann.removesuffix("|None"), rng, depth)
    if ann in ARRAY_DTYPES:
        n = int(rng.integers(0, 20))
        if ann == "F32":
            return rng.standard_normal(n).astype(np.float32)
        info = np.iinfo(np.dtype(ARRAY_DTYPES[ann]))
        return rng.integers(info.min, info.max, n, dtype=np.dtype(ARRAY_DTYPES[ann]), endpoint=True)
    if ann == "int":
        return int(rng.integers(-(2**62), 2**62))
    if ann == "float":
        return float(rng.standard_normal() * 1e6)
    if ann == "bool":
        return bool(rng.integers(0, 2))
    if ann == "str":
        return "".join(rng.choice(list("abcxyz é✓🙂/:_"), int(rng.integers(0, 30))))
    if ann == "bytes":
        return rng.bytes(int(rng.integers(0, 30)))
    if ann.startswith("list["):
        inner = ann[5:-1]
        return [random_value(inner, rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    if ann in ("object", "Any"):  # untyped on the wire: whatever msgpack carries
        kind = int(rng.integers(0, 3))
        return [random_value("str", rng), random_value("int", rng), random_value("list[int]", rng)][kind]
    if ann == "SamplingParams":  # validated at construction: random values within its ranges
        return random_sampling_params(rng)
    if ann in records.RECORD_NAMES:
        return random_message(records.RECORD_NAMES[ann], rng, depth + 1)
    raise AssertionError(f"test cannot build a value for annotation {ann!r}: extend random_value")


def random_sampling_params(rng: np.random.Generator) -> SamplingParams:
    max_tokens = int(rng.integers(1, 1 << 20))
    kw = dict(
        temperature=float(rng.uniform(0, 100)),
        top_p=float(rng.uniform(1e-6, 1)),
        top_k=int(rng.integers(-1, 1 << 40)),
        min_p=float(rng.uniform(0, 1)),
        max_tokens=max_tokens,
        min_tokens=int(rng.integers(0, max_tokens + 1)),
        stop=[random_value("str", rng) + "x" for _ in range(int(rng.integers(0, 3)))],
        stop_token_ids=[int(t) for t in rng.integers(0, 1 << 31, int(rng.integers(0, 4)))],
        ignore_eos=bool(rng.integers(0, 2)),
        seed=None if rng.random() < 0.3 else int(rng.integers(0, 2**63 - 1)),
        logprobs=None if rng.random() < 0.3 else int(rng.integers(0, 21)),
        presence_penalty=float(rng.uniform(-2, 2)),
        frequency_penalty=float(rng.uniform(-2, 2)),
        repetition_penalty=float(rng.uniform(1e-3, 10)),
        n=int(rng.integers(1, 129)),
        skip_special_tokens=bool(rng.integers(0, 2)),
        include_stop_str_in_output=bool(rng.integers(0, 2)),
        logit_bias=None
        if rng.random() < 0.3
        else {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, 1 << 31, int(rng.integers(1, 5)))},
        prompt_logprobs=None if rng.random() < 0.3 else int(rng.integers(0, 21)),
        truncate_prompt_tokens=None if rng.random() < 0.3 else int(rng.choice([-1, int(rng.integers(1, 1 << 20))])),
        structured_outputs=[
            None,
            {"choice": [random_value("str", rng) + "x", "y"]},
            {"json": {"type": "object", "properties": {random_value("str", rng): {"type": "integer"}}}},
            {"regex": random_value("str", rng) + "[0-9]+"},
        ][int(rng.integers(0, 4))],
        allowed_token_ids=None
        if rng.random() < 0.3
        else [int(t) for t in rng.integers(0, 1 << 31, int(rng.integers(1, 5)))],
    )
    assert set(kw) == {f.name for f in dataclasses.fields(SamplingParams)}, "a new field: give it a random value"
    return SamplingParams(**kw)


def random_message(cls: type, rng: np.random.Generator, depth: int = 0):
    assert depth < 5
    if cls is SamplingParams:
        return random_sampling_params(rng)
    return cls(**{f.name: random_value(f.type, rng, depth) for f in dataclasses.fields(cls)})


def assert_same(a, b, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(a, b), where
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("tag, cls", REGISTRY, ids=[cls.__name__ for _, cls in REGISTRY])
def test_round_trip_every_message(tag, cls):
    rng = np.random.default_rng(tag)
    for _ in range(25):
        msg = random_message(cls, rng)
        back = decode(encode(msg))
        assert_same(msg, back, cls.__name__)
        assert_same(msg, decode(encode(msg), expect=cls), cls.__name__)  # expect= accepts the right type
        # the raw frame is [tag, field values...]; a sparse record's is [tag, {non-default field: value}]
        raw = msgpack.unpackb(encode(msg), raw=False)
        if cls in records.SPARSE:
            assert raw[0] == tag and len(raw) == 2 and set(raw[1]) <= {f.name for f in dataclasses.fields(cls)}
        else:
            assert raw[0] == tag and len(raw) == len(dataclasses.fields(cls)) + 1


@pytest.mark.parametrize("tag, cls", REGISTRY, ids=[cls.__name__ for _, cls in REGISTRY])
def test_arrays_travel_as_packed_little_endian_bytes(tag, cls):
    rng = np.random.default_rng(100 + tag)
    msg = random_message(cls, rng)
    raw = msgpack.unpackb(encode(msg), raw=False)
    for i, f in enumerate(dataclasses.fields(cls), start=1):
        kind = f.type.replace(" ", "").removesuffix("|None")
        v = getattr(msg, f.name)
        if kind in ARRAY_DTYPES and v is not None:
            assert isinstance(raw[i], bytes), f.name
            assert raw[i] == np.asarray(v).astype(ARRAY_DTYPES[kind]).tobytes(), f.name
            assert len(raw[i]) == len(v) * np.dtype(ARRAY_DTYPES[kind]).itemsize


def test_array_byte_order_and_dtype_conversion():
    """Explicit bytes: int32 1 is 01 00 00 00 whatever the host or the input array's byte order/dtype."""
    msg = StepResult(step_id=3, rank=0, token_ids=np.array([1, 256, -2], dtype=">i8"))  # big-endian int64 in
    raw = msgpack.unpackb(encode(msg), raw=False)
    assert raw == [8, 3, 0, b"\x01\x00\x00\x00" + b"\x00\x01\x00\x00" + b"\xfe\xff\xff\xff"] + [None] * 6
    back = decode(encode(msg))
    assert back.token_ids.dtype == np.dtype("<i4") and back.token_ids.tolist() == [1, 256, -2]
    step = make_step([dict(slot=2, tokens=[7], start=5, temperature=0.5, seed=2**40 + 1, outputs=[258])])
    raw = msgpack.unpackb(encode(step), raw=False)
    assert raw[1 + STEP_FIELDS.index("new_start_pos")] == b"\x05\x00\x00\x00"
    assert raw[1 + STEP_FIELDS.index("new_past_token_ids")] == b"\x02\x01\x00\x00"
    params = raw[1 + STEP_FIELDS.index("new_params")][0]  # a nested sparse record: [tag, {field: value}]
    assert params == [records.TAG_OF[SamplingParams], {"temperature": 0.5, "seed": 2**40 + 1}]
    assert decode(encode(step)).new_params == step.new_params


def test_large_arrays_travel_as_the_same_bytes():
    """A step's token bitmasks (MBs, packed from a view) and a big-endian, strided input: the same wire bytes."""
    masks = np.arange(-(2**20), 2**20, 3, dtype=">i8")[::2]  # strided, big-endian, 1.4 MB as int32
    raw = msgpack.unpackb(encode(StepMasks(5, masks)), raw=False)
    assert raw[2] == masks.astype("<i4").tobytes()
    back = decode(encode(StepMasks(5, masks)))
    assert back.token_masks.dtype == np.dtype("<i4") and (back.token_masks == masks).all()


# ---- malformed frames ----------------------------------------------------------------------------------


def valid_hello_raw() -> list:
    return msgpack.unpackb(encode(WorkerHello(PROTOCOL_VERSION, 0, 1, "cpu", 123, "host")), raw=False)


def pack(raw) -> bytes:
    return msgpack.packb(raw, use_bin_type=True)


def step_raw() -> list:
    return msgpack.unpackb(encode(make_step([dict(slot=0, tokens=[1, 2, 3], start=0, new_blocks=[4])])), raw=False)


def with_field(raw: list, index: int, value) -> list:
    raw = list(raw)
    raw[index] = value
    return raw


MALFORMED = {
    "empty": b"",
    "garbage": b"\xc1\xc1\xc1",
    "truncated": encode(WorkerHello(1, 0, 1, "cpu", 1, "h"))[:-3],
    "trailing bytes": encode(Shutdown("x")) + b"\x00",
    "not a list": pack({"tag": 1}),
    "bare int": pack(7),
    "empty list": pack([]),
    "unknown tag": pack([999, "x"]),
    "negative tag": pack([-1, "x"]),
    "string tag": pack(["WorkerHello", 1, 0, 1, "cpu", 1, "h"]),
    "bool tag": pack([True, 1, 0, 1, "cpu", 1, "h"]),
    "too few fields": pack(valid_hello_raw()[:-1]),
    "too many fields": pack(valid_hello_raw() + ["extra"]),
    "str for int": pack(with_field(valid_hello_raw(), 1, "1")),
    "float for int": pack(with_field(valid_hello_raw(), 2, 0.5)),
    "bool for int": pack(with_field(valid_hello_raw(), 2, True)),
    "bytes for str": pack(with_field(valid_hello_raw(), 4, b"cpu")),
    "None for required": pack(with_field(valid_hello_raw(), 6, None)),
    "list for str": pack(with_field(valid_hello_raw(), 6, ["h"])),
    "int for array": pack(with_field(step_raw(), 2, 5)),
    "list for array": pack(with_field(step_raw(), 2, [0])),
    "str for array": pack(with_field(step_raw(), 2, "\x00\x00\x00\x00")),
    "int32 array of 5 bytes": pack(with_field(step_raw(), 3, b"\x01\x00\x00\x00\x02")),
    "int32 array of 6 bytes": pack(with_field(step_raw(), 1 + STEP_FIELDS.index("new_past_token_ids"), b"\x00" * 6)),
    "float32 array of 3 bytes": pack([8, 0, 0, b"", b"", b"\x00" * 3, None, None, None]),  # StepResult.logprobs
    "int for a record": pack(with_field(step_raw(), 1 + STEP_FIELDS.index("new_params"), [5])),
    "wrong record in a list": pack(with_field(step_raw(), 1 + STEP_FIELDS.index("new_params"), [valid_hello_raw()])),
    "map with int keys": pack([1, {1: 2}, 0, 1, "cpu", 1, "h"]),
    "ext type": msgpack.packb([9, msgpack.ExtType(5, b"xx")]),
}
# SamplingParams travels sparse: [10, {non-default field: value}]; every value's wire type is checked, list
# elements too (a bool is not an int)
_PARAM_NAMES = [f.name for f in dataclasses.fields(SamplingParams)]


def params_raw(**fields) -> bytes:
    return pack([records.TAG_OF[SamplingParams], fields])


MALFORMED["bool in list[int]"] = params_raw(stop_token_ids=[1, True])
MALFORMED["int in list[str]"] = params_raw(stop=["a", 3])
MALFORMED["str for list"] = params_raw(stop="a")
MALFORMED["str for float"] = params_raw(temperature="0.5")
MALFORMED["bool for int"] = params_raw(top_k=True)
MALFORMED["None for a required field"] = params_raw(temperature=None)
MALFORMED["unknown field"] = params_raw(temperature=0.5, best_of=2)
MALFORMED["positional SamplingParams (protocol 11)"] = pack([records.TAG_OF[SamplingParams], 1.0, 1.0])
MALFORMED["SamplingParams as a list"] = pack([records.TAG_OF[SamplingParams], [["temperature", 0.5]]])
# logit_bias travels as a flat [id, bias, ...] list: a map, an odd length or a non-int id is malformed
MALFORMED["logit_bias as a map"] = params_raw(logit_bias={"1": 2.0})
MALFORMED["logit_bias of odd length"] = params_raw(logit_bias=[1, 2.0, 3])
MALFORMED["logit_bias float id"] = params_raw(logit_bias=[1.0, 2.0])
MALFORMED["logit_bias str bias"] = params_raw(logit_bias=[1, "2"])


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_frames_raise_protocol_error(name):
    with pytest.raises(ProtocolError):
        decode(MALFORMED[name])


def test_wrong_expected_type_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="expected StepCommand, got Shutdown"):
        decode(encode(Shutdown("bye")), expect=StepCommand)


def test_sampling_params_travel_sparse_and_decode_checks_wire_types_only():
    """SamplingParams travels as its non-default fields by name (the default record is an empty map), so a new
    field changes neither the codec nor the protocol version. Decoding checks wire types only, on every decode
    (also once a signature is known): a worker does not re-validate what its coordinator sends."""
    assert msgpack.unpackb(encode(SamplingParams()), raw=False) == [records.TAG_OF[SamplingParams], {}]
    assert decode(encode(SamplingParams())) == SamplingParams()
    good = msgpack.unpackb(encode(SamplingParams(temperature=1, stop_token_ids=[4])), raw=False)
    assert good[1] == {"stop_token_ids": [4]}  # an int 1 equals the default 1.0: left out
    good[1]["temperature"] = 1  # an int on the wire for a float field becomes a float
    for _ in range(2):
        back = decode(pack(good))
        assert type(back.temperature) is float and back.temperature == 1.0 and back.stop_token_ids == [4]
        with pytest.raises(ProtocolError, match="stop_token_ids"):
            decode(params_raw(stop_token_ids=[True]))
        with pytest.raises(ProtocolError, match="unknown field 'best_of'"):
            decode(params_raw(best_of=2))
    a, b = decode(encode(SamplingParams())), decode(encode(SamplingParams()))
    a.stop.append("x")  # a decoded record's lists are its own, not the defaults'
    assert b.stop == [] and SamplingParams().stop == []
    # logit_bias: a dict on both ends, a flat list on the wire
    biased = SamplingParams(logit_bias={7: 2.5, 3: -100})
    assert msgpack.unpackb(encode(biased), raw=False)[1] == {"logit_bias": [7, 2.5, 3, -100]}
    assert decode(encode(biased)).logit_bias == {7: 2.5, 3: -100}
    with pytest.raises(ProtocolError, match="logit_bias"):
        decode(params_raw(logit_bias=[7, True]))
    # a value out of range is well-formed: it decodes as sent, and validate() names it where input enters
    for name, bad in [("temperature", -1.0), ("top_p", 0.0), ("min_tokens", 99), ("logprobs", 21)]:
        params = SamplingParams(max_tokens=8)
        setattr(params, name, bad)
        back = decode(encode(params))
        assert getattr(back, name) == bad
        with pytest.raises(ValueError, match=name):
            back.validate()


def test_the_coordinator_validates_a_clients_sampling_params():
    """A raw ZMQ client is untrusted: read_frame answers a Generate whose settings are out of range (or a
    structured outputs spec that does not parse, or an empty logit_bias map to normalise) with a RequestError
    naming the field, after the token and version checks; a well-formed one is normalised as construction does."""
    from coordinator.client_frames import read_frame
    from protocol.client_messages import CLIENT_PROTOCOL_VERSION, PROTOCOL, REQUEST_ERROR, Generate

    cases = [("temperature", -1.0), ("top_p", 0.0), ("min_tokens", 99), ("logprobs", 21), ("logit_bias", {-1: 1.0})]
    cases += [("logit_bias", {1: float("nan")}), ("structured_outputs", "{not json"), ("stop", [""])]
    for name, bad in cases:
        msg = Generate(CLIENT_PROTOCOL_VERSION, "r1", None, "hi", False, SamplingParams(max_tokens=8))
        setattr(msg.params, name, bad)  # after construction: the bad value reaches the wire unvalidated
        err = read_frame([b"peer", encode(msg)], None).error
        assert err is not None and err.kind == REQUEST_ERROR and err.request_id == "r1", name
        assert name in err.message, (name, err.message)
        msg.token = "wrong"  # an outsider learns nothing about its settings
        err = read_frame([b"peer", encode(msg)], b"secret").error
        assert err.kind == PROTOCOL and "unauthorized" in err.message
    msg = Generate(CLIENT_PROTOCOL_VERSION, "r2", None, "hi", False, SamplingParams())
    msg.params.logit_bias, msg.params.structured_outputs = {}, '{"regex": "[0-9]+"}'
    params = read_frame([b"peer", encode(msg)], None).request.params
    assert (
        params.logit_bias is None
        and params.structured_outputs == SamplingParams(structured_outputs={"regex": "[0-9]+"}).structured_outputs
    )


def test_fuzzed_frames_raise_only_protocol_error():
    """Random corruptions of valid frames either decode or raise ProtocolError, never anything else."""
    rng = np.random.default_rng(0)
    frames = [encode(random_message(cls, rng)) for _, cls in REGISTRY for _ in range(3)]
    frames += [rng.bytes(int(n)) for n in rng.integers(1, 64, 300)]
    outcomes = {"ok": 0, "error": 0}
    for i in range(6000):
        data = bytearray(frames[i % len(frames)])
        op = i % 3
        if op == 0 and data:
            for _ in range(int(rng.integers(1, 4))):
                data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        elif op == 1:
            data = data[: int(rng.integers(0, len(data) + 1))]
        else:
            pos = int(rng.integers(0, len(data) + 1))
            data[pos:pos] = rng.bytes(int(rng.integers(1, 8)))
        try:
            decode(bytes(data))
            outcomes["ok"] += 1
        except ProtocolError:
            outcomes["error"] += 1
    assert outcomes["error"] > 1000 and outcomes["ok"] > 0


# ---- size of a decode step -----------------------------------------------------------------------------


def decode_step(num_seqs: int, seed: int = 0) -> StepCommand:
    """A steady-state decode step: every sequence computes 1 token; one in 16 crosses into a new block."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(num_seqs):
        blocks = [int(rng.integers(0, 200_000))] if rng.random() < 1 / 16 else []
        seqs.append(dict(slot=i, tokens=[int(rng.integers(0, 151_936))], new_blocks=blocks))
    return make_step(seqs, step_id=1_000_000)


def test_decode_step_size_reported():
    """Per-sequence cost of a decode step; prints the size at 256 sequences."""
    size = len(encode(decode_step(256)))
    per_seq = (size - len(encode(decode_step(0)))) / 256
    print(f"\nStepCommand, decode step at 256 sequences: {size} bytes ({per_seq:.1f} bytes/sequence)")
    assert decode(encode(decode_step(256))).slots.shape == (256,)
    assert per_seq <= 13  # three int32 per sequence (slot, token, new-block count) + the odd block id


def test_decode_step_at_256_sequences_is_under_4_kib():
    step = decode_step(256)
    size = len(encode(step))
    assert size < 4096, f"decode StepCommand at 256 sequences is {size} bytes"
    assert size <= 3188, f"{size} bytes: more than before the per-start settings became records (3,188)"
    # a decode step lists no per-row token counts and no sample rows: every row computes and samples one token
    assert len(step.prefill_num_tokens) == 0 and len(step.skip_sample_rows) == 0


def test_generate_carries_a_client_label_and_an_older_client_gets_a_version_error():
    """Protocol 11: Generate.client (the per-client limit's label) and KeepAlive, a request like the others. A
    protocol-10 Generate (no client field) is answered with an error naming both versions, never dropped."""
    from coordinator.client_frames import read_frame
    from protocol.client_messages import CLIENT_PROTOCOL_VERSION, PROTOCOL, REQUEST_ERROR, Generate, KeepAlive

    msg = Generate(CLIENT_PROTOCOL_VERSION, "r1", None, "hi", True, SamplingParams(max_tokens=3), "user-7")
    assert read_frame([b"peer", encode(msg)], None).request.client == "user-7"
    raw = msgpack.unpackb(encode(msg), raw=False)
    old = msgpack.packb([raw[0], 10, *raw[2:-1]], use_bin_type=True)  # protocol 10's shape: one field fewer
    err = read_frame([b"peer", old], None).error
    assert err.kind == PROTOCOL and err.request_id == "r1"
    assert "protocol_version 10" in err.message and f"speaks {CLIENT_PROTOCOL_VERSION}" in err.message
    msg.client = "x" * 257  # a key of the server's per-client counts: bounded
    err = read_frame([b"peer", encode(msg)], None).error
    assert err.kind == REQUEST_ERROR and "client must be at most 256 characters" in err.message
    keepalive = read_frame([b"peer", encode(KeepAlive(CLIENT_PROTOCOL_VERSION, "keepalive", None))], None)
    assert isinstance(keepalive.request, KeepAlive) and keepalive.error is None
    wrong_token = read_frame([b"peer", encode(KeepAlive(CLIENT_PROTOCOL_VERSION, "keepalive", "bad"))], b"secret")
    assert wrong_token.request is None and wrong_token.unauthorized  # an outsider keeps nothing alive
