"""The embedded default model, and tiny random-weight checkpoints for the tests.

The default model (``python launch.py`` or ``LLM()`` with no model) is a small trained Qwen3 shipped in the package,
model/default_model/: training/train_default_model.py made it from the Python standard library's sources
(its training_record.json says which Python, how long and on what).

``write_tiny_checkpoint`` writes a random-weight checkpoint of any shape (Qwen3, or another transformers model
class) with an offline-trained byte-level BPE tokenizer: the tests' odd shapes, with HF transformers on the same
files as the oracle. Random weights use std 0.2 and random norm weights: with HF's 0.02 a tied random model just
repeats its last input token, and norm weights of exactly 1.0 hide norm bugs.
"""

from __future__ import annotations

import functools
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"  # package data (pyproject.toml)
DEFAULT_MODEL_ID = "nanoserve-tiny"  # the embedded default model's name in the HTTP API (model="nanoserve-tiny")


@dataclass(slots=True)
class TinySpec:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    seed: int = 0
    std: float = 0.2
    extra: dict = field(default_factory=dict)  # further config fields (they override the ones above)
    architecture: str = "Qwen3ForCausalLM"  # a transformers model class: its own config class builds the config
    max_shard_size: str | None = None  # e.g. "200KB": several safetensors files and an index


def _corpus(limit_bytes: int = 3_000_000) -> list[str]:
    """Local text to train on: the Python standard library's own sources (always present, offline)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total > limit_bytes:
            break
    texts.append("Hello world! The quick brown fox jumps over the lazy dog. 你好，世界。 Ünïcödé ✓ 🙂")
    return texts


def train_bpe(texts, vocab_size: int, special_tokens: list[str], eos: str, min_frequency: int = 0, **extra):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (any text encodes, no unknown token) trained on ``texts``, with
    our chat template; deterministic for a fixed input order. ``extra`` goes to the tokenizer's config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=min_frequency,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=eos, chat_template=CHAT_TEMPLATE, **extra
    )


@functools.cache
def build_tokenizer(vocab_size: int):
    return train_bpe(_corpus(), vocab_size, SPECIAL_TOKENS, "<|endoftext|>")


def write_tiny_checkpoint(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Write config.json, model.safetensors and tokenizer files into ``out_dir``; returns the path."""
    import torch
    import transformers

    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model_class = getattr(transformers, spec.architecture)
    fields = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"},
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        initializer_range=spec.std,
    )
    cfg = model_class.config_class(**{**fields, **spec.extra})
    torch.manual_seed(spec.seed)
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, spec.std)
    model = model.to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    model.save_pretrained(out, **({"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}))
    tokenizer.save_pretrained(out)
    return out


def default_model_dir() -> Path:
    """The embedded default model's directory (in the package: nothing is written at start)."""
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}: reinstall nanoserve")
    return DEFAULT_MODEL_DIR


if __name__ == "__main__":
    import sys

    print(write_tiny_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3"))
