"""The model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

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
    # mixture of experts (Qwen3-MoE); num_experts 0 = a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

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
            **_moe_fields(raw, source),
        )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has experts (HF's rule) rather than a dense MLP."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
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


def _moe_fields(raw: dict, source: str) -> dict:
    # transformers 5.x writes num_local_experts, the hub's Qwen3-MoE configs num_experts
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts")) or 0)
    if num_experts == 0:
        return {}
    top_k = int(raw.get("num_experts_per_tok", 8))
    step = int(raw.get("decoder_sparse_step", 1))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
    if step < 1:
        raise ValueError(f"{source}: decoder_sparse_step={step} must be at least 1")
    if not raw.get("moe_intermediate_size"):
        raise ValueError(f"{source}: num_experts={num_experts} but no moe_intermediate_size")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        decoder_sparse_step=step,
    )


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
