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

I32 = np.ndarray  # int32 array, travels as '<i4' bytes
I64 = np.ndarray  # int64 array, travels as '<i8' bytes
F32 = np.ndarray  # float32 array, travels as '<f4' bytes

_ARRAY_DTYPES = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "F32": np.dtype("<f4")}
_SCALARS = {"int": (int,), "float": (float, int), "str": (str,), "bool": (bool,), "bytes": (bytes,)}


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


@dataclasses.dataclass(slots=True)
class _FieldSpec:
    name: str
    kind: str  # 'array' | 'scalar' | 'any' | 'record'
    dtype: np.dtype | None = None
    types: tuple = ()
    optional: bool = False
    record: type | None = None
    is_list: bool = False
    # decoding checks exact types (msgpack yields only exact ones; a bool is never taken for an int)
    exact: frozenset = frozenset()  # a scalar's accepted types, NoneType included when optional
    elements: frozenset | None = None  # a list[scalar]'s accepted element types
    to_float: bool = False  # a float field: an int on the wire becomes a float
    pairs: bool = False  # a dict[int, float] field: a flat [key, value, ...] list on the wire


@dataclasses.dataclass(slots=True)
class _Plain:
    """A record of scalars only (SamplingParams: once per new sequence) travels without a per-field loop: out,
    one getter call; in, one look-up of its values' type signature among those already checked."""

    getter: operator.attrgetter
    lists: tuple[int, ...]  # list[scalar] fields: their elements are checked on every decode
    pairs: tuple[int, ...]  # dict[int, float] fields: flattened out, rebuilt (and checked) in
    signatures: dict[tuple, tuple[int, ...]]  # accepted type signature -> fields whose int becomes a float


_MAX_SIGNATURES = 256  # per record class: float fields sent as int and optional ones as None make a few


@dataclasses.dataclass(slots=True)
class _Sparse:
    """A sparse record's layout: its fields' names, defaults (a factory's value to compare with) and places."""

    getter: operator.attrgetter
    names: tuple[str, ...]
    defaults: tuple
    factories: tuple[tuple[int, object], ...]  # (index, default_factory) of fields with a mutable default
    index: dict[str, int]
    pairs: tuple[str, ...]  # dict[int, float] fields: a flat list on the wire


_BY_TAG: dict[int, type] = {}
_TAG_OF: dict[type, int] = {}
_SPECS: dict[type, list[_FieldSpec]] = {}
_PLAIN: dict[type, _Plain | None] = {}
_SPARSE_TYPES: set[type] = set()
_SPARSE: dict[type, _Sparse] = {}


def _spec_for(name: str, ann: str) -> _FieldSpec:
    ann = ann.replace(" ", "")
    optional = ann.endswith("|None")
    base = ann.removesuffix("|None")
    none = {type(None)} if optional else set()
    if base in _ARRAY_DTYPES:
        return _FieldSpec(name, "array", dtype=_ARRAY_DTYPES[base], optional=optional)
    if base in _SCALARS:
        exact = frozenset(_SCALARS[base]) | none
        return _FieldSpec(
            name, "scalar", types=_SCALARS[base], optional=optional, exact=exact, to_float=base == "float"
        )
    if base == "dict[int,float]":  # travels as a flat list (see the module docstring)
        return _FieldSpec(name, "scalar", types=(dict,), optional=optional, exact=frozenset({list}) | none, pairs=True)
    if base.startswith("list[") and base[5:-1] in _SCALARS:
        inner = base[5:-1]
        return _FieldSpec(
            name,
            "scalar",
            types=(list,),
            optional=optional,
            is_list=True,
            record=inner,
            exact=frozenset({list}) | none,
            elements=frozenset(_SCALARS[inner]),
        )
    if base.startswith("list[") or base in _RECORD_NAMES:
        inner = base[5:-1] if base.startswith("list[") else base
        return _FieldSpec(name, "record", optional=optional, record=inner, is_list=base.startswith("list["))
    return _FieldSpec(name, "any", optional=optional)


_RECORD_NAMES: dict[str, type] = {}


def record(tag: int, sparse: bool = False):
    """Class decorator: register a slots dataclass as a message with a fixed wire tag; ``sparse``: it travels as a
    map of its non-default fields (see the module docstring; scalar fields only)."""

    def wrap(cls: type) -> type:
        if tag in _BY_TAG:
            raise RuntimeError(f"message tag {tag} registered twice")
        _BY_TAG[tag], _TAG_OF[cls] = cls, tag
        _RECORD_NAMES[cls.__name__] = cls
        if sparse:
            _SPARSE_TYPES.add(cls)
        return cls

    return wrap


def _specs(cls: type) -> list[_FieldSpec]:
    # messages use ``from __future__ import annotations``: every annotation is a string
    specs = _SPECS.get(cls)
    if specs is None:
        specs = _SPECS[cls] = [_spec_for(f.name, f.type) for f in dataclasses.fields(cls)]
        _PLAIN[cls] = None
        # an untyped field may hold a record (sent as ext), so only records of typed scalars take the fast path
        if len(specs) > 1 and all(spec.kind == "scalar" for spec in specs):
            lists = tuple(i for i, spec in enumerate(specs) if spec.elements is not None)
            pairs = tuple(i for i, spec in enumerate(specs) if spec.pairs)
            _PLAIN[cls] = _Plain(operator.attrgetter(*(spec.name for spec in specs)), lists, pairs, {})
        if cls in _SPARSE_TYPES:
            _SPARSE[cls] = _sparse_layout(cls, specs)
    return specs


def _sparse_layout(cls: type, specs: list[_FieldSpec]) -> _Sparse:
    if _PLAIN[cls] is None:
        raise TypeError(f"{cls.__name__}: a sparse record holds scalar fields only")
    fields = dataclasses.fields(cls)
    defaults, factories = [], []
    for i, f in enumerate(fields):
        if f.default is not dataclasses.MISSING:
            defaults.append(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            defaults.append(f.default_factory())  # compared against on encode; decode makes a fresh one
            factories.append((i, f.default_factory))
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: a sparse record's fields all need defaults")
    names = tuple(f.name for f in fields)
    pairs = tuple(spec.name for spec in specs if spec.pairs)
    return _Sparse(
        _PLAIN[cls].getter, names, tuple(defaults), tuple(factories), {n: i for i, n in enumerate(names)}, pairs
    )


def _sparse_to_wire(cls: type, sparse: _Sparse, obj) -> list:
    # C-level loops: one != per field (an int 1 for a float 1.0 is left out: the decoder's default is the same)
    values = sparse.getter(obj)
    differ = list(map(operator.ne, values, sparse.defaults))
    out = dict(zip(compress(sparse.names, differ), compress(values, differ)))
    for name in sparse.pairs:
        if out.get(name) is not None:
            out[name] = _flat(out[name])
    return [_TAG_OF[cls], out]


def _sparse_from_wire(cls: type, specs: list[_FieldSpec], sparse: _Sparse, raw: list):
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
    specs = _specs(cls)
    plain = _PLAIN[cls]
    if cls in _SPARSE:
        return _sparse_to_wire(cls, _SPARSE[cls], obj)
    if plain is not None:  # scalars travel as they are, a dict as a flat list
        out = [_TAG_OF[cls], *plain.getter(obj)]
        for i in plain.pairs:
            if out[i + 1] is not None:
                out[i + 1] = _flat(out[i + 1])
        return out
    out = [_TAG_OF[cls]]
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
        elif type(v) in _TAG_OF:  # a record in an untyped field (e.g. a chat prompt in Generate.prompt)
            out.append(msgpack.ExtType(_NESTED_EXT, msgpack.packb(_to_wire(v), use_bin_type=True)))
        else:
            out.append(v)
    return out


def _flat(d: dict) -> list:
    return [x for kv in d.items() for x in kv]


def _scalar(cls: type, spec: _FieldSpec, v):
    """A scalar field's value (an int in a float field becomes a float), or a ProtocolError naming the field."""
    if type(v) not in spec.exact:
        what = "missing value" if v is None else f"expected {spec.types[0].__name__}, got {type(v).__name__}"
        raise ProtocolError(f"{cls.__name__}.{spec.name}: {what}")
    if spec.elements is not None and v and not all(type(x) in spec.elements for x in v):
        raise ProtocolError(f"{cls.__name__}.{spec.name}: expected a list of {spec.record}")
    if spec.pairs and v is not None:
        return _pairs(cls, spec, v)
    return float(v) if spec.to_float and type(v) is int else v


def _pairs(cls: type, spec: _FieldSpec, flat: list) -> dict:
    """A dict[int, float] from its flat wire list, or a ProtocolError naming the field."""
    keys, values = flat[::2], flat[1::2]
    if len(keys) != len(values) or not all(type(k) is int for k in keys):
        raise ProtocolError(f"{cls.__name__}.{spec.name}: expected [int key, float value, ...]")
    if not all(type(v) is float or type(v) is int for v in values):
        raise ProtocolError(f"{cls.__name__}.{spec.name}: expected [int key, float value, ...]")
    return dict(zip(keys, values))


def _plain_values(cls: type, specs: list[_FieldSpec], plain: _Plain, values: list) -> list:
    signature = tuple(map(type, values))
    floats = plain.signatures.get(signature)
    if floats is None:  # first time this signature: check each field
        values = [_scalar(cls, spec, v) for spec, v in zip(specs, values)]
        if len(plain.signatures) < _MAX_SIGNATURES:
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
    cls = _BY_TAG.get(raw[0])
    if cls is None:
        raise ProtocolError(f"unknown message tag {raw[0]}")
    if expect is not None and cls is not expect:
        raise ProtocolError(f"expected {expect.__name__}, got {cls.__name__}")
    specs = _specs(cls)
    sparse = _SPARSE.get(cls)
    if sparse is not None:
        return _sparse_from_wire(cls, specs, sparse, raw)
    if len(raw) != len(specs) + 1:
        raise ProtocolError(f"{cls.__name__}: expected {len(specs)} fields, got {len(raw) - 1}")
    plain = _PLAIN[cls]
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
