"""The per-step forward context: set by the worker's runner around each forward, read by attention layers.

This is how paging metadata reaches the model without entering its signature.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from kernels.attention import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    meta: AttentionMetadata | None = None
    backend: AttentionBackend | None = None


_CONTEXT = ForwardContext()


def get_context() -> ForwardContext:
    return _CONTEXT


@contextmanager
def forward_context(meta: AttentionMetadata, backend: AttentionBackend):
    _CONTEXT.meta, _CONTEXT.backend = meta, backend
    try:
        yield _CONTEXT
    finally:
        _CONTEXT.meta = None
