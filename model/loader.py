"""Build a model on its target device and dtype and fill it from safetensors (or with random weights).

Loading reads each file's header (model/safetensors_reader.py), plans where every tensor goes and which of its rows
this rank needs (model/checkpoint_plan.py), then streams those bytes in file order to the device
(model/weight_stream.py) and hands each tensor to its parameter's ``weight_loader``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import closing
from itertools import groupby
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from model.checkpoint_plan import CheckpointPlan, Target, rows
from model.config import ModelConfig
from model.fp8 import resolve_quantization
from model.fp8_linear import prepare_checkpoint_params, quantize_loaded
from model.registry import model_class
from model.safetensors_reader import read_header
from model.weight_stream import Piece, stream


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} is listed in model.safetensors.index.json but missing")
    return files


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Parameters are allocated directly on ``device`` in ``dtype``; no full copy on the CPU first."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model


READERS = ("auto", "staged", "mmap", "safetensors")


def load_weights(model: nn.Module, model_dir: str | Path, reader: str = "auto") -> None:
    """Copy every checkpoint tensor through its parameter's weight_loader; error on any gap. ``reader``: ours
    (model/weight_stream.py: only this rank's bytes, in file order), "staged" (a reader thread and staging copies,
    "auto" on CUDA) or "mmap" (views of the mapped file, "auto" on the CPU); or "safetensors" (its own
    ``get_tensor``, whole tensors: the reference the tests and benchmarks/load_weights.py compare against)."""
    if reader not in READERS:
        raise ValueError(f"reader: unsupported value {reader!r}; choose one of {', '.join(READERS)}")
    model_dir = Path(model_dir)
    plan = CheckpointPlan(model)
    pieces = plan_pieces(plan, checkpoint_files(model_dir))
    device = next(model.parameters()).device
    if reader == "safetensors":
        tensors = _safetensors_tensors(pieces)
    else:
        tensors = stream(pieces, device, staged=None if reader == "auto" else reader == "staged")
    loaded: set[tuple[str, object]] = set()
    with closing(tensors):
        for piece, tensor in tensors:
            _load_one(piece, tensor)
            loaded.add(piece.target.key)
    missing = sorted(set(plan.expected()) - loaded, key=str)
    if missing:
        names = [plan.checkpoint_name(key) for key in missing]
        raise ValueError(f"checkpoint {model_dir} is missing tensors: {', '.join(names[:8])}")


def plan_pieces(plan: CheckpointPlan, files: list[Path]) -> list[Piece]:
    """The tensors of ``files`` that the model takes, in file order, each with the rows this rank reads."""
    pieces = []
    for file in files:
        for entry in read_header(file):
            target = plan.target(entry.name)
            if target is not None:
                pieces.append(Piece(file, entry, *rows(target, entry), target))
    return pieces


def _load_one(piece: Piece, tensor: torch.Tensor) -> None:
    target: Target = piece.target
    param, loader, shard = target.param, target.loader, target.key[1]
    try:
        if tensor.dtype == torch.float8_e4m3fn and param.dtype != tensor.dtype:
            raise ValueError("float8 weights need an fp8 quantization_config in config.json")
        if loader is None:
            if param.shape != tensor.shape:
                have, want = tuple(tensor.shape), tuple(param.shape)
                raise ValueError(f"shape mismatch: checkpoint has {have}, model expects {want}")
            param.data.copy_(tensor)
        elif shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
    except ValueError as e:
        raise ValueError(f"{piece.path.name}: tensor {piece.entry.name!r}: {e}") from None


def _safetensors_tensors(pieces: list[Piece]) -> Iterator[tuple[Piece, torch.Tensor]]:
    for path, group in groupby(pieces, key=lambda p: p.path):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for piece in group:
                yield piece, f.get_tensor(piece.entry.name)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarking real shapes: small normal values, norms at one."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def load_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str = "",
    reader: str = "auto",
) -> nn.Module:
    """``quantization``: "fp8" quantizes a 16-bit checkpoint's linear layers at load; an FP8 checkpoint loads as
    stored either way (model/fp8_linear.py). ``reader``: see ``load_weights``."""
    cfg = ModelConfig.from_pretrained(model_dir)
    fp8 = resolve_quantization(cfg.quantization, quantization)
    model = build_model(cfg, device, dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        if fp8 is not None and cfg.quantization is not None:
            prepare_checkpoint_params(model, fp8)
        load_weights(model, model_dir, reader)
    else:
        raise ValueError(f"load_format: unsupported value {load_format!r}; choose auto or dummy")
    if fp8 is not None and (load_format == "dummy" or cfg.quantization is None):
        quantize_loaded(model, fp8)
    return model.eval()
