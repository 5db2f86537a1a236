"""Real model shapes for benchmarking without weights: config.json fields, a stand-in tokenizer, size arithmetic.

    python -m benchmarks.shapes [NAME ...]     # write the shape dirs and print their sizes

``write_shape(name)`` writes ``config.json`` and a tokenizer into ``$NANOSERVE_CACHE/shapes/NAME`` (default
``~/.cache/nanoserve/shapes/NAME``) and returns the directory; run the engine on it with ``load_format="dummy"``.
The shapes are copied from the hub config.json files (benchmarks/WORKLOADS.md, "Model shapes"). The tokenizer is a
word-level stand-in that covers every id of the model's vocabulary (``t0``, ``t1``, ...; Qwen's special tokens at
their real ids), so any sampled id decodes; the benchmarks feed token-id prompts and never depend on its text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from settings.env import settings

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_parameters": {"rope_theta": 1_000_000.0, "rope_type": "default"},
    "rope_scaling": None,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "dtype": "bfloat16",
}

# Qwen's special tokens (real ids in the 151,936-entry vocabulary)
_QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # meta-llama/Llama-3.1-8B-Instruct's config.json as published (transformers 4.x spelling: rope_scaling beside
    # rope_theta, torch_dtype; head_dim = hidden / heads = 128)
    "llama3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "qwen3-30b-a3b": {
        **_QWEN3_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "max_window_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # CPU smoke runs only: float32, and a vocabulary > 10,000 so the workloads' token ids (< 10,000) are valid
    "tiny": {
        **_QWEN3_COMMON,
        "vocab_size": 10240,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "bos_token_id": 10237,
        "eos_token_id": 10239,
        "dtype": "float32",
    },
}

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def shapes_dir() -> Path:
    return settings().cache_dir / "shapes"


def _specials(vocab_size: int) -> dict[str, int]:
    if vocab_size > max(_QWEN_SPECIALS.values()):
        return dict(_QWEN_SPECIALS)
    return {name: vocab_size - 3 + i for i, name in enumerate(_QWEN_SPECIALS)}


def build_stand_in_tokenizer(vocab_size: int):
    """A word-level tokenizer with exactly ``vocab_size`` ids: ``t{id}`` for ordinary ids, Qwen's specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = _specials(vocab_size)
    by_id = {i: name for name, i in specials.items()}
    vocab = {by_id.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def write_shape(name: str, root: str | Path | None = None) -> Path:
    """Write (once) config.json + tokenizer for shape ``name``; returns the model directory."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    cfg = SHAPES[name]
    out = Path(root) if root is not None else shapes_dir() / name
    cfg_file = out / "config.json"
    if cfg_file.is_file() and json.loads(cfg_file.read_text()) == cfg and (out / "tokenizer.json").is_file():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    build_stand_in_tokenizer(cfg["vocab_size"]).save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.replace(out)
    return out


def load_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _moe_layers(cfg: dict) -> int:
    """Decoder layers with experts (HF's rule: not in mlp_only_layers, every decoder_sparse_step-th layer)."""
    if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
        return 0
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    return sum(1 for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def model_stats(cfg: dict, dtype: str | None = None) -> dict:
    """Parameter counts and bytes for the roofline, from config.json fields.

    ``layer_params``: the decoder-layer weights (+ the final norm) every token multiplies through; for MoE layers
    the router and its top_k experts only.
    ``lm_head_params``: vocab x hidden, read by every decode step whether tied or not (the embedding *lookup*
    reads only the rows it needs, so a separate input embedding is not counted in the bytes per step).
    ``weight_bytes_per_step``: what every decode step reads whatever its batch: all weights but the experts,
    whose share depends on the batch (``step_weight_bytes``).
    """
    h, inter, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or h // heads
    vocab = cfg["vocab_size"]
    dtype = dtype if dtype and dtype != "auto" else cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    nbytes = DTYPE_BYTES[dtype]
    arch = (cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
    qk_norm = 2 * head_dim if arch.startswith("Qwen3") else 0  # Qwen3's per-head q and k norm weights
    qkv_bias = cfg.get("attention_bias") or arch.startswith("Qwen2")  # Qwen2 always has q, k, v biases
    attn_bias = qkv_bias * (heads + 2 * kv_heads) * head_dim + bool(cfg.get("attention_bias")) * h
    mlp_bias = bool(cfg.get("mlp_bias")) * (2 * inter + h)
    attn = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + qk_norm + attn_bias
    moe_layers = _moe_layers(cfg)
    experts = (cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe_layers else 0
    top_k = cfg.get("num_experts_per_tok", 0) if moe_layers else 0
    expert = 3 * h * cfg.get("moe_intermediate_size", 0)  # one expert's gate, up and down
    dense_mlp = 3 * h * inter + mlp_bias
    shared = n_layers * (attn + 2 * h) + (n_layers - moe_layers) * dense_mlp + moe_layers * experts * h + h
    layer_params = shared + moe_layers * top_k * expert
    lm_head = vocab * h
    embed = 0 if cfg.get("tie_word_embeddings") else vocab * h
    return {
        "dtype": dtype,
        "dtype_bytes": nbytes,
        "layer_params": layer_params,
        "lm_head_params": lm_head,
        "total_params": shared + moe_layers * experts * expert + lm_head + embed,
        "weight_bytes_per_step": (shared + lm_head) * nbytes,
        "moe_layers": moe_layers,
        "num_experts": experts,
        "top_k": top_k,
        "expert_bytes": expert * nbytes,
        "kv_bytes_per_token": n_layers * 2 * kv_heads * head_dim * nbytes,
        "num_layers": n_layers,
        "num_heads": heads,
        "head_dim": head_dim,
        "hidden_size": h,
        "vocab_size": vocab,
    }


def step_weight_bytes(stats: dict, batch: int) -> float:
    """Weight bytes a decode step of ``batch`` tokens reads: ``weight_bytes_per_step`` plus, per MoE layer, the
    experts the batch routes to: E * (1 - (1 - k/E)^batch) distinct ones expected under uniform routing."""
    experts = stats["num_experts"]
    if not experts:
        return stats["weight_bytes_per_step"]
    hit = experts * (1 - (1 - stats["top_k"] / experts) ** batch)
    return stats["weight_bytes_per_step"] + stats["moe_layers"] * hit * stats["expert_bytes"]


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"shapes to write: {', '.join(SHAPES)} (default: all)")
    names = p.parse_args().names
    for name in names:
        if name not in SHAPES:  # argparse's choices refuse an empty list for nargs="*" on Python < 3.12
            p.error(f"argument NAME: invalid choice: {name!r} (choose from {', '.join(SHAPES)})")
    for shape in names or list(SHAPES):
        st = model_stats(SHAPES[shape])
        print(
            f"{shape:13s} {write_shape(shape)}  params {st['total_params'] / 1e9:.3f} B  weights/step "
            f"{step_weight_bytes(st, 1) / 1e9:.2f} GB (1 token) .. {step_weight_bytes(st, 256) / 1e9:.2f} GB "
            f"(256)  KV/token {st['kv_bytes_per_token']:,} B"
        )
