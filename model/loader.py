"""Build a model on its target device and dtype and fill it from safetensors (or with random weights)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from model.config import ModelConfig
from model.fp8 import resolve_quantization
from model.fp8_linear import prepare_checkpoint_params, quantize_loaded
from model.registry import model_class

# a per-expert checkpoint tensor: "<prefix>.experts.<expert>.<projection>.weight"
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


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


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor through its parameter's weight_loader; error on any gap."""
    model_dir = Path(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = getattr(model, "packed_modules_mapping", {})
    # projection -> stacked parameter, for models whose experts live in one parameter per projection kind
    experts = getattr(model, "expert_params_mapping", {})
    expected = {(name, shard) for name, shard in _expected_pieces(model, params, mapping)}
    loaded: set[tuple[str, object]] = set()
    tied = getattr(model.config, "tie_word_embeddings", False)
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if "rotary_emb.inv_freq" in ckpt_name or (tied and ckpt_name == "lm_head.weight"):
                    continue
                name, shard = ckpt_name, None
                expert = _EXPERT_TENSOR.search(ckpt_name) if experts else None
                if expert is not None and expert[2] in experts:
                    name = f"{ckpt_name[: expert.start()]}.experts.{experts[expert[2]]}"
                    shard = (int(expert[1]), expert[2])
                else:
                    for src, (dst, shard_id) in mapping.items():
                        if f".{src}." in ckpt_name:
                            name, shard = ckpt_name.replace(f".{src}.", f".{dst}."), shard_id
                            break
                param = params.get(name)
                if param is None:
                    continue  # tensors we do not use (e.g. extra heads) are ignored
                loader = getattr(param, "weight_loader", None)
                try:
                    tensor = f.get_tensor(ckpt_name)
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
                    raise ValueError(f"{file.name}: tensor {ckpt_name!r}: {e}") from None
                loaded.add((name, shard))
    missing = sorted(expected - loaded, key=str)
    if missing:
        names = [_checkpoint_name(n, s, mapping) for n, s in missing]
        raise ValueError(f"checkpoint {model_dir} is missing tensors: {', '.join(names[:8])}")


def _expected_pieces(model, params, mapping):
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        own = getattr(params[name], "checkpoint_shards", None)  # stacked experts: (expert, projection) each
        if own is not None:
            yield from ((name, s) for s in own)
            continue
        shards = [shard for src, (dst, shard) in mapping.items() if f".{dst}." in name]
        yield from ((name, s) for s in shards) if shards else [(name, None)]


def _checkpoint_name(name: str, shard: object, mapping: dict) -> str:
    if isinstance(shard, tuple):  # (expert, projection) of a stacked expert parameter "<prefix>.experts.<param>"
        return f"{name.rsplit('.', 1)[0]}.{shard[0]}.{shard[1]}.weight"
    for src, (dst, shard_id) in mapping.items():
        if f".{dst}." in name and shard_id == shard:
            return name.replace(f".{dst}.", f".{src}.")
    return name


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
) -> nn.Module:
    """``quantization``: "fp8" quantizes a 16-bit checkpoint's linear layers at load; an FP8 checkpoint loads as
    stored either way (model/fp8_linear.py)."""
    cfg = ModelConfig.from_pretrained(model_dir)
    fp8 = resolve_quantization(cfg.quantization, quantization)
    model = build_model(cfg, device, dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        if fp8 is not None and cfg.quantization is not None:
            prepare_checkpoint_params(model, fp8)
        load_weights(model, model_dir)
    else:
        raise ValueError(f"load_format: unsupported value {load_format!r}; choose auto or dummy")
    if fp8 is not None and (load_format == "dummy" or cfg.quantization is None):
        quantize_loaded(model, fp8)
    return model.eval()
