"""The engine's tokenizer, from a local directory. Any checkpoint's goes through transformers' ``AutoTokenizer``;
the embedded default model's (model/default_model/) is built by its class directly: its tokenizer_config.json names
``PreTrainedTokenizerFast``, which is what AutoTokenizer returns for it too (tests/coordinator/test_tokenizer_loader.py
compares the two), and skipping AutoTokenizer's import (transformers' auto-configuration tree and, through it,
torch) takes ~0.4 s of CPU off a start-up that is otherwise ~2 s."""

from __future__ import annotations

from pathlib import Path

from model.tiny import DEFAULT_MODEL_DIR


def is_embedded_model(source: str | Path) -> bool:
    """Whether ``source`` is the embedded default model's directory (however it is spelled)."""
    try:
        return Path(source).resolve() == DEFAULT_MODEL_DIR.resolve()
    except (OSError, RuntimeError, ValueError):  # an unresolvable path is not ours
        return False


def tokenizer_class(source: str | Path) -> type:
    """The class whose ``from_pretrained`` loads the tokenizer at ``source`` ("": the embedded model's, the engine's
    default) (imported here: a launcher calls this early so that the import's time counts as its imports')."""
    if not source or is_embedded_model(source):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(source: str | Path):
    """The tokenizer at ``source`` (a local directory), as ``AutoTokenizer.from_pretrained(source)`` returns it."""
    return tokenizer_class(source).from_pretrained(source)
