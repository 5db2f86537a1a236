"""msgpack encoding of typed records (never pickle).

A record is a slots dataclass registered with a tag. It travels as ``[tag, field values...]``; fields
annotated ``I32``/``I64``/``F32`` are numpy arrays that travel as packed little-endian bytes, so encode and
decode of a whole batch is one ``tobytes``/``frombuffer`` per array. A record inside a field annotated ``object``
travels as msgpack ext type 1 holding its own packed list. Decoding checks every field's type, so a
malformed frame raises ``ProtocolError`` instead of reaching the engine.
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np

I32 = np.ndarray  # int32 array, travels as '<i4' bytes
I64 = np.ndarray  # int64 array, travels as '<i8' bytes
F32 = np.ndarray  # float32 array, travels as '<f4' bytes

_ARRAY_DTYPES = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "F32": np.dtype("<f4")}
_SCALARS = {"int": (int,), "float": (float, int), "str": (str,), "bool": (bool,), "bytes": (bytes,)}


_NESTED_EXT = 1  # msgpack ext type of a record inside an untyped (``object``) field


class ProtocolError(ValueError):
    """A frame that is not a valid message."""


@dataclasses.dataclass(slots=True)
class _Nested:
    """A record found inside an untyped field, decoded once its place is known (so errors name the field)."""

    data: bytes


def _ext_hook(code: int, data: bytes):
    return _Nested(data) if code == _NESTED_EXT else msgpack.ExtType(code, data)


@dataclasses.dataclass(slots=True)
class _FieldSpec:
    name: str
    kind: str  # 'array' | 'scalar' | 'any' | 'record'
    dtype: np.dtype | None = None
    types: tuple = ()
    optional: bool = False
    record: type | None = None
    is_list: bool = False


_BY_TAG: dict[int, type] = {}
_TAG_OF: dict[type, int] = {}
_SPECS: dict[type, list[_FieldSpec]] = {}


def _spec_for(name: str, ann: str) -> _FieldSpec:
    ann = ann.replace(" ", "")
    optional = ann.endswith("|None")
    base = ann.removesuffix("|None")
    if base in _ARRAY_DTYPES:
        return _FieldSpec(name, "array", dtype=_ARRAY_DTYPES[base], optional=optional)
    if base in _SCALARS:
        return _FieldSpec(name, "scalar", types=_SCALARS[base], optional=optional)
    if base.startswith("list[") and base[5:-1] in _SCALARS:
        return _FieldSpec(name, "scalar", types=(list,), optional=optional, is_list=True, record=base[5:-1])
    if base.startswith("list[") or base in _RECORD_NAMES:
        inner = base[5:-1] if base.startswith("list[") else base
        return _FieldSpec(name, "record", optional=optional, record=inner, is_list=base.startswith("list["))
    return _FieldSpec(name, "any", optional=optional)


_RECORD_NAMES: dict[str, type] = {}


def record(tag: int):
    """Class decorator: register a slots dataclass as a message with a fixed wire tag."""

    def wrap(cls: type) -> type:
        if tag in _BY_TAG:
            raise RuntimeError(f"message tag {tag} registered twice")
        _BY_TAG[tag], _TAG_OF[cls] = cls, tag
        _RECORD_NAMES[cls.__name__] = cls
        return cls

    return wrap


def _specs(cls: type) -> list[_FieldSpec]:
    # messages use ``from __future__ import annotations``: every annotation is a string
    specs = _SPECS.get(cls)
    if specs is None:
        specs = _SPECS[cls] = [_spec_for(f.name, f.type) for f in dataclasses.fields(cls)]
    return specs


def _to_wire(obj):
    cls = type(obj)
    out = [_TAG_OF[cls]]
    for spec in _specs(cls):
        v = getattr(obj, spec.name)
        if v is None:
            out.append(None)
        elif spec.kind == "array":
            out.append(np.ascontiguousarray(v, dtype=spec.dtype).tobytes())
        elif spec.kind == "record":
            out.append([_to_wire(x) for x in v] if spec.is_list else _to_wire(v))
        elif type(v) in _TAG_OF:  # a record in an untyped field (e.g. a chat prompt in Generate.prompt)
            out.append(msgpack.ExtType(_NESTED_EXT, msgpack.packb(_to_wire(v), use_bin_type=True)))
        else:
            out.append(v)
    return out


def _from_wire(raw, expect: type | None = None):
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], int) or isinstance(raw[0], bool):
        raise ProtocolError("frame is not a tagged message")
    cls = _BY_TAG.get(raw[0])
    if cls is None:
        raise ProtocolError(f"unknown message tag {raw[0]}")
    if expect is not None and cls is not expect:
        raise ProtocolError(f"expected {expect.__name__}, got {cls.__name__}")
    specs = _specs(cls)
    if len(raw) != len(specs) + 1:
        raise ProtocolError(f"{cls.__name__}: expected {len(specs)} fields, got {len(raw) - 1}")
    values = []
    for spec, v in zip(specs, raw[1:]):
        if v is None:
            if not spec.optional:
                raise ProtocolError(f"{cls.__name__}.{spec.name}: missing value")
            values.append(None)
        elif spec.kind == "array":
            if not isinstance(v, bytes) or len(v) % spec.dtype.itemsize:
                raise ProtocolError(f"{cls.__name__}.{spec.name}: expected packed {spec.dtype} bytes")
            values.append(np.frombuffer(v, dtype=spec.dtype))
        elif spec.kind == "scalar":
            if not isinstance(v, spec.types) or (isinstance(v, bool) and bool not in spec.types):
                raise ProtocolError(
                    f"{cls.__name__}.{spec.name}: expected {spec.types[0].__name__}, got {type(v).__name__}"
                )
            if spec.is_list and not all(
                isinstance(x, _SCALARS[spec.record]) and (spec.record == "bool" or not isinstance(x, bool)) for x in v
            ):
                raise ProtocolError(f"{cls.__name__}.{spec.name}: expected a list of {spec.record}")
            values.append(float(v) if float in spec.types and not isinstance(v, bool) else v)
        elif spec.kind == "record":
            target = _RECORD_NAMES[spec.record]
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
    return cls(*values)


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
    except Exception as e:  # a constructor's own validation (e.g. __post_init__)
        raise ProtocolError(str(e)) from None
