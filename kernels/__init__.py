"""GPU kernels (Triton) and their torch fallbacks, run in the worker processes, one module per kernel family."""

from __future__ import annotations

import importlib.util


def __getattr__(name: str):
    # Hugging Face's `kernels` package has this same top-level name, and transformers imports it when it is
    # installed (transformers >= 5.25 requires it): this package shadows it, so say so instead of a bare ImportError.
    if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(name)  # dunders, and our own modules not imported yet (the import system loads them)
    raise ImportError(
        f"cannot import {name!r} from nanoserve's kernels package: it shadows Hugging Face's `kernels` package, "
        "which this environment's transformers tries to use. Use transformers < 5.25 and uninstall `kernels` "
        "(pip uninstall kernels)."
    )
