"""Write a random-weight safetensors checkpoint of a real model shape (benchmarks/shapes.py), streamed to disk.

    python -m benchmarks.write_checkpoint qwen3-0.6b [--shard-gb 4]

The tensor names and shapes are transformers' own (the model class built on the meta device), so the files look like
a hub checkpoint: HF's names, shards of at most ``--shard-gb`` in module order, each file's tensors sorted by name as
safetensors writes them, and ``model.safetensors.index.json`` when there are several. Values are bf16 of magnitude
1/128 to 1/64 with random signs and mantissas: plausible weights, and bytes no disk can compress or deduplicate.
The checkpoint is cached under ``$NANOSERVE_CACHE/checkpoints/NAME``; a marker written last says it is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.shapes import write_shape
from settings.env import settings

_CHUNK = 64 << 20
_POOL_WORDS = 64 << 20  # 128 MB of random bf16 words, reused with a different sign/mantissa mask per chunk
_SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(slots=True)
class Written:
    model_dir: Path
    nbytes: int
    seconds: float  # 0.0 when the cached checkpoint was used


def checkpoint_dir(name: str) -> Path:
    return settings().cache_dir / "checkpoints" / name


def tensor_shapes(model_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor transformers' model class would save, in module order."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # tied lm_head is a duplicate: left out


def _split(tensors, dtype: str, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    files, size = [[]], 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * _BYTES[dtype]
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += nbytes
    return files


def _header(tensors, dtype: str) -> tuple[bytes, int]:
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in sorted(tensors):
        nbytes = int(np.prod(shape)) * _BYTES[dtype]
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(raw)) + raw, offset


class _Noise:
    """Chunks of random bf16 bytes: one random pool, a fresh sign/mantissa mask per chunk."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.pool = (rng.integers(0, 1 << 16, _POOL_WORDS, dtype=np.uint16) & 0x807F) | 0x3C00
        self.buf = np.empty(_CHUNK // 2, np.uint16)
        self.count = 0

    def chunk(self, nbytes: int) -> memoryview:
        self.count += 1
        start = (self.count * 7919 * 4096) % (_POOL_WORDS - _CHUNK // 2)
        out = self.buf[: nbytes // 2]
        np.bitwise_xor(self.pool[start : start + out.size], np.uint16((self.count * 40503) & 0x807F), out=out)
        return memoryview(out).cast("B")


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (no root needed: the file's own pages, written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_checkpoint(name: str, shard_gb: float = 4.0, out: Path | None = None, seed: int = 0) -> Written:
    """Write (once) shape ``name``'s random checkpoint; returns where, its size and the seconds writing took."""
    out = out or checkpoint_dir(name)
    marker = out / "nanoserve_checkpoint.json"
    want = {"shape": name, "shard_gb": shard_gb, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()).get("layout") == want:
        return Written(out, json.loads(marker.read_text())["nbytes"], 0.0)
    if out.exists():
        shutil.rmtree(out)
    write_shape(name, out)
    dtype = _SAFETENSORS_DTYPE[json.loads((out / "config.json").read_text()).get("dtype", "bfloat16")]
    groups = _split(tensor_shapes(out), dtype, int(shard_gb * (1 << 30)))
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    if len(groups) == 1:
        names = ["model.safetensors"]
    noise, total, weight_map = _Noise(seed), 0, {}
    start = time.perf_counter()
    for fname, group in zip(names, groups):
        header, nbytes = _header(group, dtype)
        with open(out / fname, "wb") as f:
            f.write(header)
            left = nbytes
            while left:
                n = min(left, _CHUNK)
                f.write(noise.chunk(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
        total += nbytes
        weight_map.update({t: fname for t, _ in group})
    seconds = time.perf_counter() - start
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    marker.write_text(json.dumps({"layout": want, "nbytes": total, "write_s": seconds}) + "\n")
    return Written(out, total, seconds)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("shape", help="the model shape (benchmarks/shapes.py)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="GB a safetensors file")
    args = ap.parse_args()
    w = write_checkpoint(args.shape, args.shard_gb)
    print(
        f"{w.model_dir}: {w.nbytes / 1e9:.2f} GB"
        + (f", written at {w.nbytes / w.seconds / 1e9:.2f} GB/s" if w.seconds else " (cached)")
    )
