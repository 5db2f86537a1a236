"""A Hugging Face cache on disk, laid out as huggingface_hub writes it: ``models--ORG--NAME/`` with ``refs/<branch>``
(a commit hash), ``snapshots/<commit>/<file>`` (relative symlinks) and ``blobs/<content hash>`` (the bytes)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def commit_hash(label: str) -> str:
    """A 40-hex commit id (what refs hold and snapshots are named by), derived from ``label``."""
    return hashlib.sha1(label.encode()).hexdigest()


def add_snapshot(cache: Path, repo_id: str, checkpoint: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``checkpoint``'s files into ``cache`` as commit ``commit`` of ``repo_id``, which ``refs`` (branches or
    tags) point at; returns the snapshot folder."""
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes the hash without a newline
    return snapshot
