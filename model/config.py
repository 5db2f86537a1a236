"""The model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from model.registry import ARCHITECTURES
from settings.defaults import DTYPE_ALIASES

if TYPE_CHECKING:  # torch loads on first use of a dtype: the coordinator reads configs without it (~1.2 s of CPU)
    import torch

    from model.fp8 import Fp8Config

_DTYPES = ("float32", "float16", "bfloat16")  # torch's names

# rope_type -> the parameters it needs (HF's names); these rotate every position the same way at any length
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """A checkpoint's RoPE frequency scaling (HF ``rope_parameters`` / ``rope_scaling``); model/rotary.py turns
    it into frequencies. ``attention_factor`` scales cos and sin (yarn's mscale; 1.0 for the other types)."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # llama3, yarn: the pretraining context length
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float = 1.0

    @classmethod
    def from_dict(cls, params: dict, raw: dict, source: str) -> RopeScaling:
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in _ROPE_REQUIRED:
            raise ValueError(
                f"{source}: rope_type {rope_type!r} is not supported; nanoserve supports {', '.join(_ROPE_REQUIRED)}"
            )
        if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor other than 1.0 is not supported")
        missing = [key for key in _ROPE_REQUIRED[rope_type] if params.get(key) is None]
        if rope_type == "yarn" and missing and params.get("original_max_position_embeddings"):
            missing = []  # HF derives yarn's factor from the two context lengths
        if missing:
            raise ValueError(f"{source}: rope_type {rope_type!r} needs {', '.join(missing)} in its rope parameters")
        if rope_type == "default":
            return cls()
        max_pos = raw.get("max_position_embeddings", 32768)
        # a top-level original_max_position_embeddings wins over the rope dict's, as in HF
        original = int(
            raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos
        )
        factor = float(params["factor"] if params.get("factor") is not None else max_pos / original)
        kw = {}
        if rope_type == "llama3":
            kw = dict(
                low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"])
            )
        elif rope_type == "yarn":
            kw = dict(
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                truncate=bool(params.get("truncate", True)),
                attention_factor=_yarn_attention_factor(params, factor),
            )
        return cls(rope_type, factor, original, **kw)


def _yarn_attention_factor(params: dict, factor: float) -> float:
    """YaRN's scale of cos/sin: explicit, else 0.1 ln(factor) + 1 (a ratio of two such terms with mscale and
    mscale_all_dim, DeepSeek's variant)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def _sliding_window(raw: dict) -> int | None:
    """The attention window a checkpoint's layers use, None when every layer attends to the whole context
    (Qwen2/Qwen3 carry a window that only ``use_sliding_window`` / ``layer_types`` switch on)."""
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window", True) is False:
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


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
    dtype_name: str  # one of _DTYPES; ``dtype`` is the torch dtype
    eos_token_id: tuple[int, ...]
    rope_scaling: RopeScaling = RopeScaling()
    mlp_bias: bool = False
    sliding_window: int | None = None  # tokens each layer attends back over; None = the whole context
    # mixture of experts (Qwen3-MoE); num_experts 0 = a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    quantization: Fp8Config | None = None  # a block-FP8 checkpoint's quantization_config (model/fp8.py)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or [raw.get("model_type", "?")]
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{source}: unsupported architecture {arch!r}; nanoserve supports {sorted(ARCHITECTURES)}")
        # transformers 5.x writes rope_parameters/dtype; 4.x checkpoints carry rope_scaling (its type under "type"
        # in older ones), rope_theta and torch_dtype. HF lets a non-empty rope_scaling win, and so do we.
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        rope_theta = (
            rope.get("rope_theta")
            or raw.get("rope_theta")
            or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        )
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
            dtype_name=dtype_name,
            eos_token_id=eos_ids,
            rope_scaling=RopeScaling.from_dict(rope, raw, source),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=_sliding_window(raw),
            **_moe_fields(raw, source),
            quantization=_quantization(raw.get("quantization_config"), source),
        )

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has experts (HF's rule) rather than a dense MLP."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a context this model cannot serve exactly: sliding-window attention is not implemented, so a
        windowed checkpoint is served only while no sequence can reach past its window."""
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise ValueError(
                f"{self.architecture} uses sliding-window attention over {self.sliding_window} tokens, which "
                f"nanoserve does not implement; it is served exactly only with max_model_len <= {self.sliding_window}"
                f" (got max_model_len={max_model_len}): pass max_model_len={self.sliding_window} or less"
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


def _quantization(raw: dict | None, source: str) -> Fp8Config | None:
    if not raw:  # model/fp8.py (and torch with it) only for a checkpoint that has a quantization_config
        return None
    from model.fp8 import parse_quantization_config

    return parse_quantization_config(raw, source)


def parse_dtype(name: str | torch.dtype, default: torch.dtype) -> torch.dtype:
    """Engine-arg dtype ("auto" = the checkpoint's) to a torch dtype."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return default
    name = DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"dtype: unsupported value {name!r}; choose auto, float32, float16 or bfloat16")
    return getattr(torch, name)
