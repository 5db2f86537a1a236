"""The model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from model.fp8 import Fp8Config, parse_quantization_config
from model.registry import ARCHITECTURES

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: torch.dtype
    eos_token_id: tuple[int, ...]
    quantization: Fp8Config | None = None  # a block-FP8 checkpoint's quantization_config (model/fp8.py)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or [raw.get("model_type", "?")]
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{source}: unsupported architecture {arch!r}; nanoserve supports {sorted(ARCHITECTURES)}")
        # transformers 5.x writes rope_parameters/dtype; 4.x checkpoints carry rope_theta/torch_dtype.
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or {}  # older 4.x configs spell its key "type"
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in ("default", None):
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported (only default RoPE)")
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        if dtype_name not in _DTYPES:
            raise ValueError(f"{source}: unsupported dtype {dtype_name!r}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            dtype=_DTYPES[dtype_name],
            eos_token_id=eos_ids,
            quantization=parse_quantization_config(raw.get("quantization_config"), source),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} is missing: not a Hugging Face checkpoint directory")
        return cls.from_dict(json.loads(cfg_file.read_text()), source=str(cfg_file))


def parse_dtype(name: str | torch.dtype, default: torch.dtype) -> torch.dtype:
    """Engine-arg dtype ("auto" = the checkpoint's) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return default
    aliases = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
    name = aliases.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"dtype: unsupported value {name!r}; choose auto, float32, float16 or bfloat16")
    return _DTYPES[name]
