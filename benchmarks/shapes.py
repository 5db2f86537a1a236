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

from protocol.settings import settings

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


def model_stats(cfg: dict, dtype: str | None = None) -> dict:
    """Parameter counts and bytes for the roofline, from config.json fields.

    ``layer_params``: all decoder-layer weights (+ the final norm): what every token multiplies through.
    ``lm_head_params``: vocab x hidden, read by every decode step whether tied or not (the embedding *lookup*
    reads only the rows it needs, so a separate input embedding is not counted in the bytes per step).
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
    bias = qkv_bias * (heads + 2 * kv_heads) * head_dim + bool(cfg.get("attention_bias")) * h
    bias += bool(cfg.get("mlp_bias")) * (2 * inter + h)
    attn = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + qk_norm
    mlp = 3 * h * inter + bias
    layer = attn + mlp + 2 * h
    layer_params = n_layers * layer + h
    lm_head = vocab * h
    embed = 0 if cfg.get("tie_word_embeddings") else vocab * h
    return {
        "dtype": dtype,
        "dtype_bytes": nbytes,
        "layer_params": layer_params,
        "lm_head_params": lm_head,
        "total_params": layer_params + lm_head + embed,
        "weight_bytes_per_step": (layer_params + lm_head) * nbytes,
        "kv_bytes_per_token": n_layers * 2 * kv_heads * head_dim * nbytes,
        "num_layers": n_layers,
        "num_heads": heads,
        "head_dim": head_dim,
        "hidden_size": h,
        "vocab_size": vocab,
    }


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
            f"{shape:12s} {write_shape(shape)}  params {st['total_params'] / 1e9:.3f} B  "
            f"weights/step {st['weight_bytes_per_step'] / 1e9:.2f} GB  KV/token {st['kv_bytes_per_token']:,} B"
        )
