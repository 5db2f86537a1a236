"""An EAGLE-3 draft checkpoint in its public layout (as published for Llama-3.1-8B-Instruct and Qwen3-8B), read and
checked against its target before anything loads: config.json's fields and the safetensors tensors' names and shapes
(headers only, plus the small ``d2t`` table). Every refusal names the field or tensor that does not fit.

The layout: one decoder layer (``midlayer.*``, or ``layers.0.*``) whose q/k/v take 2 x hidden inputs (the token's
embedding and the fused feature, concatenated), ``fc`` (3 x target hidden -> hidden: the three target hidden states
fused), ``norm``, its own ``lm_head`` over ``draft_vocab_size`` tokens, ``d2t`` (draft id -> target id offset) and
``t2d`` (unused here); ``embed_tokens.weight`` is optional (absent: the target's embedding is shared). The target
states fed to ``fc`` are the residual streams entering the target layers ``eagle_aux_hidden_state_layer_ids``
(default (2, L // 2, L - 3) of an L-layer target, vLLM's convention: id 0 is the embedding)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from model.config import ModelConfig, RopeScaling

DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# our names (midlayer.* as published; layers.0.* and a "model." prefix are read as the same tensors)
LAYER = "midlayer."


class Eagle3CheckpointError(ValueError):
    """A draft checkpoint that does not fit its target; the message names the field or tensor."""


@dataclass(slots=True, frozen=True)
class Eagle3Config:
    directory: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary (draft ids map into it)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool  # the fused feature is normed before it becomes the residual (some trainers)
    attention_bias: bool
    has_embedding: bool  # embed_tokens.weight in the checkpoint; else the target's is shared
    has_d2t: bool

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the draft needs, by its checkpoint name (``midlayer.`` form), and its shape."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        shapes = layer_shapes(h, q, kv, self.intermediate_size, self.draft_vocab_size, self.target_hidden_size)
        if self.attention_bias:
            shapes.update({f"{LAYER}self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
        if self.has_embedding:
            shapes["embed_tokens.weight"] = (self.vocab_size, h)
        if self.has_d2t:
            shapes["d2t"] = (self.draft_vocab_size,)
        return shapes


def layer_shapes(
    hidden: int,
    q_width: int,
    kv_width: int,
    intermediate: int,
    draft_vocab: int,
    target_hidden: int,
    layer: str = LAYER,
) -> dict[str, tuple[int, ...]]:
    """The public layout's weights (no biases, embedding or d2t) and their shapes; ``layer``: the layer's prefix."""
    h = hidden
    return {
        "fc.weight": (h, 3 * target_hidden),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
        f"{layer}hidden_norm.weight": (h,),
        f"{layer}input_layernorm.weight": (h,),
        f"{layer}post_attention_layernorm.weight": (h,),
        f"{layer}self_attn.q_proj.weight": (q_width, 2 * h),
        f"{layer}self_attn.k_proj.weight": (kv_width, 2 * h),
        f"{layer}self_attn.v_proj.weight": (kv_width, 2 * h),
        f"{layer}self_attn.o_proj.weight": (h, q_width),
        f"{layer}mlp.gate_proj.weight": (intermediate, h),
        f"{layer}mlp.up_proj.weight": (intermediate, h),
        f"{layer}mlp.down_proj.weight": (h, intermediate),
    }


def layout_config(
    hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int, draft_vocab: int, **extra
) -> dict:
    """A config.json of the public layout (one Llama-style layer), ``extra`` fields added (a checkpoint writer's:
    eps, RoPE, positions, dtype)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        **extra,
    }


def our_name(ckpt_name: str) -> str:
    """A checkpoint tensor's name in the published form (``model.`` prefix dropped, ``layers.0.`` as ``midlayer.``)."""
    name = ckpt_name.removeprefix("model.")
    return LAYER + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def tensor_files(directory: Path) -> dict[str, Path]:
    """Each tensor's file, by its published name."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise Eagle3CheckpointError(
            f"{directory}: no *.safetensors files (a pickled pytorch_model.bin is never loaded: convert it to "
            "safetensors)"
        )
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            where.update({our_name(k): f for k in st.keys()})
    return where


def read_eagle3(directory: str | Path, target: ModelConfig) -> Eagle3Config:
    """The draft's config, checked against ``target`` (config.json fields, then every tensor's shape and the d2t
    table); Eagle3CheckpointError names the first misfit."""
    path = Path(directory)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise Eagle3CheckpointError(f"{cfg_file} is missing: not a draft checkpoint directory")
    raw = json.loads(cfg_file.read_text())
    src = str(cfg_file)
    archs = raw.get("architectures") or []
    if not any(a in DRAFT_ARCHITECTURES for a in archs):
        raise Eagle3CheckpointError(
            f"{src}: architectures {archs} is not an EAGLE-3 draft (expected one of {', '.join(DRAFT_ARCHITECTURES)})"
        )
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise Eagle3CheckpointError(f"{src}: num_hidden_layers={raw['num_hidden_layers']}: EAGLE-3 drafts have 1")

    def need(key: str):
        if raw.get(key) is None:
            raise Eagle3CheckpointError(f"{src}: {key} is missing")
        return raw[key]

    vocab = int(need("vocab_size"))
    if vocab != target.vocab_size:
        raise Eagle3CheckpointError(f"{src}: vocab_size={vocab} but the target's vocab_size is {target.vocab_size}")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    target_hidden = int(raw.get("target_hidden_size") or hidden)
    if target_hidden != target.hidden_size:
        field = "target_hidden_size" if raw.get("target_hidden_size") else "hidden_size"
        raise Eagle3CheckpointError(
            f"{src}: {field}={target_hidden} but the target's hidden_size is {target.hidden_size}"
        )
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise Eagle3CheckpointError(f"{src}: draft_vocab_size={draft_vocab} must be in 1..vocab_size ({vocab})")
    layers = target.num_hidden_layers
    eagle = raw.get("eagle_config") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in (ids or (2, layers // 2, layers - 3)))
    if len(ids) != 3 or not all(0 <= i < layers for i in ids):
        raise Eagle3CheckpointError(
            f"{src}: eagle_aux_hidden_state_layer_ids {list(ids)} must be 3 target layers in 0..{layers - 1} (the "
            f"default (2, L // 2, L - 3) needs a target of 4 layers or more; set the field for a shallower target)"
        )
    where = tensor_files(path)
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    cfg = Eagle3Config(
        directory=str(path),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or 10000.0),
        rope_scaling=RopeScaling.from_dict(rope, raw, src),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden,
        aux_layer_ids=ids,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        has_embedding="embed_tokens.weight" in where,
        has_d2t="d2t" in where,
    )
    if not cfg.has_embedding and hidden != target.hidden_size:
        raise Eagle3CheckpointError(
            f"{src}: no embed_tokens.weight, so the target's embedding is shared, but hidden_size={hidden} differs "
            f"from the target's {target.hidden_size}"
        )
    if draft_vocab != vocab and not cfg.has_d2t:
        raise Eagle3CheckpointError(f"{path}: tensor 'd2t' is missing (draft_vocab_size {draft_vocab} != {vocab})")
    _check_tensors(cfg, where)
    return cfg


def _check_tensors(cfg: Eagle3Config, where: dict[str, Path]) -> None:
    from safetensors import safe_open

    reverse = {}
    for name, f in where.items():
        reverse.setdefault(f, []).append(name)
    shapes = {}
    for f in reverse:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[our_name(k)] = tuple(st.get_slice(k).get_shape())
    for name, want in cfg.expected_tensors().items():
        if name not in shapes:
            raise Eagle3CheckpointError(f"{cfg.directory}: tensor {name!r} is missing")
        if shapes[name] != want:
            raise Eagle3CheckpointError(
                f"{cfg.directory}: tensor {name!r} has shape {shapes[name]}, the target needs {want}"
            )
    if cfg.has_d2t:
        d2t = load_tensor(where, "d2t").long()
        ids = d2t + torch.arange(len(d2t))
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise Eagle3CheckpointError(
                f"{cfg.directory}: tensor 'd2t' maps draft ids outside the target vocabulary (0..{cfg.vocab_size - 1})"
            )


def load_tensor(where: dict[str, Path], name: str):
    """One tensor by its published name."""
    from safetensors import safe_open

    with safe_open(str(where[name]), framework="pt") as st:
        for k in st.keys():
            if our_name(k) == name:
                return st.get_tensor(k)
    raise KeyError(name)
