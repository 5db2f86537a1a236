"""msgpack encoding of typed records (never pickle).

A record is a slots dataclass registered with a tag. It travels as ``[tag, field values...]``; fields annotated
``I32``/``I64``/``F32`` are numpy arrays that travel as packed little-endian bytes, so encode and decode of a whole
batch is one ``tobytes`` (a view, for large ones) and one ``frombuffer`` per array. Decoding checks every field's
type, so a malformed frame raises ``ProtocolError`` instead of reaching the engine; a record whose own validation
rejects a value raises its subclass ``InvalidValue``. Records nest: a field annotated with a record's class name (or
a list of them) travels as that record's list, and a record inside a field annotated ``object`` travels as msgpack
ext type 1 holding its own packed list. A ``dict[int, float]`` field (SamplingParams.logit_bias) travels as a flat
list ``[key, value, key, value, ...]``: msgpack maps are decoded with string keys only.

A *sparse* record (``@record(tag, sparse=True)``: SamplingParams) travels as ``[tag, {field: value}]`` holding only
the fields that differ from their defaults, so a new field needs no codec or protocol-version change: an older
peer names it as an unknown field, a newer one takes its default when it is missing. Decoding checks the wire
types only and builds the record without its ``__post_init__``: the receiver validates what it does not trust
(the coordinator a client's Generate; a worker trusts its coordinator).
"""

from __future__ import annotations

import dataclasses
import operator
from collections import deque
from itertools import compress, repeat

import msgpack
import numpy as np

from protocol.records import (
    BY_TAG,
    MAX_SIGNATURES,
    PLAIN,
    RECORD_NAMES,
    SPARSE,
    TAG_OF,
    FieldSpec,
    PlainLayout,
    SparseLayout,
    specs_of,
)

I32 = np.ndarray  # int32 array, travels as '<i4' bytes
I64 = np.ndarray  # int64 array, travels as '<i8' bytes
F32 = np.ndarray  # float32 array, travels as '<f4' bytes


_VIEW_FROM_BYTES = 1 << 16  # arrays this large are packed from a memoryview (per array, dearer on small ones)
_NESTED_EXT = 1  # msgpack ext type of a record inside an untyped (``object``) field


class ProtocolError(ValueError):
    """A frame that is not a valid message."""


class InvalidValue(ProtocolError):
    """A well-formed record whose own validation rejected a value (e.g. SamplingParams' ranges); the message
    names the field."""


@dataclasses.dataclass(slots=True)
class _Nested:
    """A record found inside an untyped field, decoded once its place is known (so errors name the field)."""

    data: bytes


def _ext_hook(code: int, data: bytes):
    return _Nested(data) if code == _NESTED_EXT else msgpack.ExtType(code, data)


def _sparse_to_wire(cls: type, sparse: SparseLayout, obj) -> list:
    # C-level loops: one != per field (an int 1 for a float 1.0 is left out: the decoder's default is the same)
    values = sparse.getter(obj)
    differ = list(map(operator.ne, values, sparse.defaults))
    out = dict(zip(compress(sparse.names, differ), compress(values, differ)))
    for name in sparse.pairs:
        if out.get(name) is not None:
            out[name] = _flat(out[name])
    return [TAG_OF[cls], out]


def _sparse_from_wire(cls: type, specs: list[FieldSpec], sparse: SparseLayout, raw: list):
    """The record from its map of non-default fields: wire types checked, no ``__post_init__``."""
    if len(raw) != 2 or type(raw[1]) is not dict:
        raise ProtocolError(f"{cls.__name__}: expected a map of its non-default fields")
    values = list(sparse.defaults)
    for i, factory in sparse.factories:
        values[i] = factory()
    index = sparse.index
    for name, v in raw[1].items():
        i = index.get(name)
        if i is None:
            raise ProtocolError(f"{cls.__name__}: unknown field {name!r} (a peer of a newer version?)")
        values[i] = _scalar(cls, specs[i], v)
    obj = object.__new__(cls)
    deque(map(setattr, repeat(obj), sparse.names, values), maxlen=0)  # every slot set, in one C-level loop
    return obj


def _to_wire(obj):
    cls = type(obj)
    specs = specs_of(cls)
    plain = PLAIN[cls]
    if cls in SPARSE:
        return _sparse_to_wire(cls, SPARSE[cls], obj)
    if plain is not None:  # scalars travel as they are, a dict as a flat list
        out = [TAG_OF[cls], *plain.getter(obj)]
        for i in plain.pairs:
            if out[i + 1] is not None:
                out[i + 1] = _flat(out[i + 1])
        return out
    out = [TAG_OF[cls]]
    for spec in specs:
        v = getattr(obj, spec.name)
        if v is None:
            out.append(None)
        elif spec.kind == "array":
            arr = np.ascontiguousarray(v, dtype=spec.dtype)
            # a large array (a step's token bitmasks: MBs) is packed from a view: its bytes copy took 10x longer
            out.append(arr.tobytes() if arr.nbytes < _VIEW_FROM_BYTES else memoryview(arr).cast("B"))
        elif spec.kind == "record":
            out.append([_to_wire(x) for x in v] if spec.is_list else _to_wire(v))
        elif spec.pairs:
            out.append(_flat(v))
        elif type(v) in TAG_OF:  # a record in an untyped field (e.g. a chat prompt in Generate.prompt)
            out.append(msgpack.ExtType(_NESTED_EXT, msgpack.packb(_to_wire(v), use_bin_type=True)))
        else:
            out.append(v)
    return out


def _flat(d: dict) -> list:
    return [x for kv in d.items() for x in kv]


def _scalar(cls: type, spec: FieldSpec, v):
    """A scalar field's value (an int in a float field becomes a float), or a ProtocolError naming the field."""
    if type(v) not in spec.exact:
        what = "missing value" if v is None else f"expected {spec.types[0].__name__}, got {type(v).__name__}"
        raise ProtocolError(f"{cls.__name__}.{spec.name}: {what}")
    if spec.elements is not None and v and not all(type(x) in spec.elements for x in v):
        raise ProtocolError(f"{cls.__name__}.{spec.name}: expected a list of {spec.record}")
    if spec.pairs and v is not None:
        return _pairs(cls, spec, v)
    return float(v) if spec.to_float and type(v) is int else v


def _pairs(cls: type, spec: FieldSpec, flat: list) -> dict:
    """A dict[int, float] from its flat wire list, or a ProtocolError naming the field."""
    keys, values = flat[::2], flat[1::2]
    if len(keys) != len(values) or not all(type(k) is int for k in keys):
        raise ProtocolError(f"{cls.__name__}.{spec.name}: expected [int key, float value, ...]")
    if not all(type(v) is float or type(v) is int for v in values):
        raise ProtocolError(f"{cls.__name__}.{spec.name}: expected [int key, float value, ...]")
    return dict(zip(keys, values))


def _plain_values(cls: type, specs: list[FieldSpec], plain: PlainLayout, values: list) -> list:
    signature = tuple(map(type, values))
    floats = plain.signatures.get(signature)
    if floats is None:  # first time this signature: check each field
        values = [_scalar(cls, spec, v) for spec, v in zip(specs, values)]
        if len(plain.signatures) < MAX_SIGNATURES:
            plain.signatures[signature] = tuple(i for i, t in enumerate(signature) if t is int and specs[i].to_float)
        return values
    for i in plain.lists:
        v = values[i]
        if v and not all(type(x) in specs[i].elements for x in v):
            raise ProtocolError(f"{cls.__name__}.{specs[i].name}: expected a list of {specs[i].record}")
    for i in floats:
        values[i] = float(values[i])
    for i in plain.pairs:
        if values[i] is not None:
            values[i] = _pairs(cls, specs[i], values[i])
    return values


def _from_wire(raw, expect: type | None = None):
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], int) or isinstance(raw[0], bool):
        raise ProtocolError("frame is not a tagged message")
    cls = BY_TAG.get(raw[0])
    if cls is None:
        raise ProtocolError(f"unknown message tag {raw[0]}")
    if expect is not None and cls is not expect:
        raise ProtocolError(f"expected {expect.__name__}, got {cls.__name__}")
    specs = specs_of(cls)
    sparse = SPARSE.get(cls)
    if sparse is not None:
        return _sparse_from_wire(cls, specs, sparse, raw)
    if len(raw) != len(specs) + 1:
        raise ProtocolError(f"{cls.__name__}: expected {len(specs)} fields, got {len(raw) - 1}")
    plain = PLAIN[cls]
    values = _plain_values(cls, specs, plain, raw[1:]) if plain is not None else []
    for spec, v in zip(specs, raw[1:]) if plain is None else ():
        kind = spec.kind
        if kind == "scalar":
            values.append(_scalar(cls, spec, v))
        elif v is None:
            if not spec.optional:
                raise ProtocolError(f"{cls.__name__}.{spec.name}: missing value")
            values.append(None)
        elif kind == "array":
            if not isinstance(v, bytes) or len(v) % spec.dtype.itemsize:
                raise ProtocolError(f"{cls.__name__}.{spec.name}: expected packed {spec.dtype} bytes")
            values.append(np.frombuffer(v, dtype=spec.dtype))
        elif kind == "record":
            target = RECORD_NAMES[spec.record]
            if spec.is_list:
                if not isinstance(v, list):
                    raise ProtocolError(f"{cls.__name__}.{spec.name}: expected a list")
                values.append([_from_wire(x, target) for x in v])
            else:
                values.append(_from_wire(v, target))
        elif isinstance(v, _Nested):
            try:
                inner = _unpack(v.data)
            except Exception as e:
                raise ProtocolError(f"{cls.__name__}.{spec.name}: undecodable record ({type(e).__name__})") from None
            values.append(_from_wire(inner))
        else:
            values.append(v)
    try:
        return cls(*values)
    except (ValueError, TypeError) as e:  # the record's own validation (__post_init__)
        raise InvalidValue(str(e)) from None


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=1 << 30, ext_hook=_ext_hook)


def encode(msg) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(data: bytes, expect: type | None = None):
    """Bytes to a record; raises ProtocolError on anything malformed (never another exception type)."""
    try:
        raw = _unpack(data)
    except Exception as e:  # msgpack raises several types on garbage
        raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None
    try:
        return _from_wire(raw, expect)
    except ProtocolError:
        raise
    except Exception as e:  # anything else a garbled frame trips over
        raise ProtocolError(str(e)) from None
