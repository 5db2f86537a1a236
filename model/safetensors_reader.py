"""A safetensors file's table of contents, read by us: an 8-byte little-endian header length, a JSON header
(tensor name -> dtype, shape, byte range relative to the data) and the raw bytes. Knowing each tensor's byte range
lets the loader read exactly the bytes it needs in file order (model/weight_stream.py). Every inconsistency is an
error naming the file and, where there is one, the tensor: a truncated download fails here, before any reading."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(slots=True, frozen=True)
class TensorEntry:
    """One tensor of a file: its bytes are ``nbytes`` from file offset ``start``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def rows(self) -> int:
        """Entries along dim 0 (a 0-d tensor is one row): the unit in which a rank reads part of a tensor."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows if self.rows else 0


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of safetensors file ``path`` in file-offset order, each checked to fit its shape and the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file: {size} bytes, too short for the header length")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, _MAX_HEADER):
            raise ValueError(f"{path}: not a safetensors file or truncated: header of {length} bytes in {size}")
        header = f.read(length)
    try:
        meta = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    base = 8 + length
    entries = [_entry(path, name, info, base) for name, info in meta.items() if name != "__metadata__"]
    entries.sort(key=lambda e: (e.start, e.nbytes))
    for prev, e in zip(entries, entries[1:]):
        if e.start < prev.start + prev.nbytes:
            raise ValueError(f"{path}: tensor {e.name!r}: its bytes overlap those of tensor {prev.name!r}")
    for e in entries:
        if e.start + e.nbytes > size:
            raise ValueError(
                f"{path}: tensor {e.name!r}: the file is truncated: its bytes end at {e.start + e.nbytes}, "
                f"the file has {size}"
            )
    return entries


def _entry(path: Path, name: str, info: object, base: int) -> TensorEntry:
    try:
        dtype_name, shape, (a, b) = info["dtype"], info["shape"], info["data_offsets"]
        shape = tuple(int(n) for n in shape)
        a, b = int(a), int(b)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: tensor {name!r}: malformed header entry {info!r}") from None
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"{path}: tensor {name!r}: unsupported dtype {dtype_name!r}")
    want = math.prod(shape) * dtype.itemsize
    if min(shape, default=0) < 0 or a < 0 or b - a != want:
        raise ValueError(
            f"{path}: tensor {name!r}: byte range {a}..{b} does not hold shape {list(shape)} of {dtype_name} "
            f"({want} bytes)"
        )
    return TensorEntry(name, dtype, shape, base + a, want)
