"""The record registry and each record's wire layout: which tag a class travels under, and what each field's
annotation means on the wire (an array's dtype, a scalar's accepted types, a nested record, a flat dict). The
codec (protocol/codec.py) encodes and decodes with these layouts; a layout is worked out once per class."""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

ARRAY_DTYPES = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "F32": np.dtype("<f4")}
SCALARS = {"int": (int,), "float": (float, int), "str": (str,), "bool": (bool,), "bytes": (bytes,)}


@dataclasses.dataclass(slots=True)
class FieldSpec:
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
class PlainLayout:
    """A record of scalars only (SamplingParams: once per new sequence) travels without a per-field loop: out,
    one getter call; in, one look-up of its values' type signature among those already checked."""

    getter: operator.attrgetter
    lists: tuple[int, ...]  # list[scalar] fields: their elements are checked on every decode
    pairs: tuple[int, ...]  # dict[int, float] fields: flattened out, rebuilt (and checked) in
    signatures: dict[tuple, tuple[int, ...]]  # accepted type signature -> fields whose int becomes a float


MAX_SIGNATURES = 256  # per record class: float fields sent as int and optional ones as None make a few


@dataclasses.dataclass(slots=True)
class SparseLayout:
    """A sparse record's layout: its fields' names, defaults (a factory's value to compare with) and places."""

    getter: operator.attrgetter
    names: tuple[str, ...]
    defaults: tuple
    factories: tuple[tuple[int, object], ...]  # (index, default_factory) of fields with a mutable default
    index: dict[str, int]
    pairs: tuple[str, ...]  # dict[int, float] fields: a flat list on the wire


BY_TAG: dict[int, type] = {}
TAG_OF: dict[type, int] = {}
SPECS: dict[type, list[FieldSpec]] = {}
PLAIN: dict[type, PlainLayout | None] = {}
SPARSE_TYPES: set[type] = set()
SPARSE: dict[type, SparseLayout] = {}


def spec_for(name: str, ann: str) -> FieldSpec:
    ann = ann.replace(" ", "")
    optional = ann.endswith("|None")
    base = ann.removesuffix("|None")
    none = {type(None)} if optional else set()
    if base in ARRAY_DTYPES:
        return FieldSpec(name, "array", dtype=ARRAY_DTYPES[base], optional=optional)
    if base in SCALARS:
        exact = frozenset(SCALARS[base]) | none
        return FieldSpec(name, "scalar", types=SCALARS[base], optional=optional, exact=exact, to_float=base == "float")
    if base == "dict[int,float]":  # travels as a flat list (see the module docstring)
        return FieldSpec(name, "scalar", types=(dict,), optional=optional, exact=frozenset({list}) | none, pairs=True)
    if base.startswith("list[") and base[5:-1] in SCALARS:
        inner = base[5:-1]
        return FieldSpec(
            name,
            "scalar",
            types=(list,),
            optional=optional,
            is_list=True,
            record=inner,
            exact=frozenset({list}) | none,
            elements=frozenset(SCALARS[inner]),
        )
    if base.startswith("list[") or base in RECORD_NAMES:
        inner = base[5:-1] if base.startswith("list[") else base
        return FieldSpec(name, "record", optional=optional, record=inner, is_list=base.startswith("list["))
    return FieldSpec(name, "any", optional=optional)


RECORD_NAMES: dict[str, type] = {}


def record(tag: int, sparse: bool = False):
    """Class decorator: register a slots dataclass as a message with a fixed wire tag; ``sparse``: it travels as a
    map of its non-default fields (see the module docstring; scalar fields only)."""

    def wrap(cls: type) -> type:
        if tag in BY_TAG:
            raise RuntimeError(f"message tag {tag} registered twice")
        BY_TAG[tag], TAG_OF[cls] = cls, tag
        RECORD_NAMES[cls.__name__] = cls
        if sparse:
            SPARSE_TYPES.add(cls)
        return cls

    return wrap


def specs_of(cls: type) -> list[FieldSpec]:
    # messages use ``from __future__ import annotations``: every annotation is a string
    specs = SPECS.get(cls)
    if specs is None:
        specs = SPECS[cls] = [spec_for(f.name, f.type) for f in dataclasses.fields(cls)]
        PLAIN[cls] = None
        # an untyped field may hold a record (sent as ext), so only records of typed scalars take the fast path
        if len(specs) > 1 and all(spec.kind == "scalar" for spec in specs):
            lists = tuple(i for i, spec in enumerate(specs) if spec.elements is not None)
            pairs = tuple(i for i, spec in enumerate(specs) if spec.pairs)
            PLAIN[cls] = PlainLayout(operator.attrgetter(*(spec.name for spec in specs)), lists, pairs, {})
        if cls in SPARSE_TYPES:
            SPARSE[cls] = sparse_layout(cls, specs)
    return specs


def sparse_layout(cls: type, specs: list[FieldSpec]) -> SparseLayout:
    if PLAIN[cls] is None:
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
    return SparseLayout(
        PLAIN[cls].getter, names, tuple(defaults), tuple(factories), {n: i for i, n in enumerate(names)}, pairs
    )
