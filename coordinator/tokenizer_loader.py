"""The engine's tokenizer, from a local directory, as ``AutoTokenizer.from_pretrained`` builds it, without paying
for AutoTokenizer's import where that can be avoided: its auto-configuration tree brings in torch and, with
transformers 5.17, torch.distributed and sympy (8.8 s of a GPU host's start, log 53c).

- The embedded default model's (model/default_model/) is built by its class directly: its tokenizer_config.json
  names ``PreTrainedTokenizerFast``, which is what AutoTokenizer returns for it too.
- Any other directory goes through AutoTokenizer once; the class it chose is then kept in
  ``$NANOSERVE_CACHE/tokenizer_class/`` (safe to delete), keyed by the transformers version, the directory's
  file names, sizes and times and its two config files' contents, so a later start builds that class directly,
  as AutoTokenizer would have. A changed file, another transformers or an entry that fails goes back to
  AutoTokenizer. tests/coordinator/test_tokenizer_loader.py compares both ways."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from importlib.metadata import version
from pathlib import Path

import xxhash

from model.tiny import DEFAULT_MODEL_DIR
from settings.env import settings

CACHE_KIND = "tokenizer_class"


def is_embedded_model(source: str | Path) -> bool:
    """Whether ``source`` is the embedded default model's directory (however it is spelled)."""
    try:
        return Path(source).resolve() == DEFAULT_MODEL_DIR.resolve()
    except (OSError, RuntimeError, ValueError):  # an unresolvable path is not ours
        return False


def tokenizer_class(source: str | Path) -> type:
    """The class whose ``from_pretrained`` loads the tokenizer at ``source`` ("": the embedded model's, the engine's
    default) on a first start: the embedded model's own, AutoTokenizer for any other."""
    if not source or is_embedded_model(source):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(source: str | Path):
    """The tokenizer at ``source`` (a local directory), as ``AutoTokenizer.from_pretrained(source)`` returns it."""
    if not source or is_embedded_model(source):
        return tokenizer_class(source).from_pretrained(source)
    entry = _entry_path(Path(source))
    known = _known_class(entry)
    if known is not None:
        try:
            return known.from_pretrained(source, _from_auto=True)  # the call AutoTokenizer makes of it
        except Exception:  # the entry no longer fits (a damaged install, a hand edit): ask AutoTokenizer again
            pass
    tokenizer = tokenizer_class(source).from_pretrained(source)
    _remember(entry, type(tokenizer))
    return tokenizer


def _entry_path(directory: Path) -> Path | None:
    """Where the class AutoTokenizer picks for ``directory`` is kept, or None where the directory cannot be read."""
    h = xxhash.xxh64()
    try:
        h.update(version("transformers").encode())
        for path in sorted(directory.iterdir()):
            st = path.stat()
            h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        for name in ("tokenizer_config.json", "config.json"):
            if (directory / name).is_file():
                h.update((directory / name).read_bytes())
    except (OSError, ImportError):  # unreadable, or transformers without its metadata
        return None
    return settings().cache_dir / CACHE_KIND / f"{h.hexdigest()}.json"


def _known_class(entry: Path | None) -> type | None:
    if entry is None:
        return None
    try:
        data = json.loads(entry.read_text())
        module = importlib.import_module(data["module"])
        return getattr(module, data["name"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None


def _remember(entry: Path | None, cls: type) -> None:
    """Keep ``cls`` for the next start: only transformers' own classes (never a checkpoint's remote code)."""
    if entry is None or not cls.__module__.startswith("transformers."):
        return
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"module": cls.__module__, "name": cls.__qualname__}))
        os.replace(tmp, entry)
    except OSError:  # an unwritable cache only costs the next start AutoTokenizer's import
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
