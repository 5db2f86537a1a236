"""The default model's text: the Python standard library's own sources (every Python installation ships them).

Files are taken in sorted path order; a fixed ~2% of them (chosen by a hash of the relative path, so the split does
not depend on any seed or on which other files exist) is held out for perplexity and never trained on, tokenizer
included. A few chat-shaped examples (a request naming a function, the function as the reply) are made from the
training files' top-level functions, so that the chat template has something to answer with.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from pathlib import Path

from model.tiny import SPECIAL_TOKENS

HELD_OUT_PER_MILLE = 20
EOT, IM_START, IM_END = SPECIAL_TOKENS  # model/tiny.py's: the random test checkpoints' chat format too


def stdlib_root(override: Path | None = None) -> Path:
    """This interpreter's standard library, or ``override``: a copy of another's (some distributions ship the
    standard library without its test suite, a third of its sources)."""
    return override or Path(sysconfig.get_paths()["stdlib"])


def python_version(stdlib: Path | None = None) -> str:
    """The Python version whose standard library this is: a copy names it in a VERSION file beside its sources."""
    if stdlib is not None and (stdlib / "VERSION").is_file():
        return (stdlib / "VERSION").read_text().strip()
    return ".".join(map(str, sys.version_info[:3]))


def held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 1000 < HELD_OUT_PER_MILLE


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 ``*.py`` file under the standard library, site-packages excluded."""
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    return out


def split(files: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training files, held-out files)."""
    train = [f for f in files if not held_out(f[0])]
    held = [f for f in files if held_out(f[0])]
    return train, held


def chat_examples(files: list[tuple[str, str]], max_chars: int = 1500) -> list[str]:
    """Chat-template texts: the user names a function (and its docstring's first line), the assistant writes it."""
    out = []
    for _, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            src = ast.get_source_segment(text, node)
            if not src or len(src) > max_chars:
                continue
            doc = (ast.get_docstring(node) or "").strip().splitlines()
            ask = f"Write a Python function `{node.name}`" + (f": {doc[0]}" if doc else ".")
            reply = f"```python\n{src}\n```"
            out.append(f"{IM_START}user\n{ask}{IM_END}\n{IM_START}assistant\n{reply}{IM_END}\n")
    return out


def documents(files: list[tuple[str, str]], with_chat: bool = True) -> list[str]:
    """The training documents, in a fixed order: every file, then the chat examples made from them."""
    return [text for _, text in files] + (chat_examples(files) if with_chat else [])
