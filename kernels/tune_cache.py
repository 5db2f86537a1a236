"""Start-up choices that take seconds to make and come out the same each time (kernels/cublaslt_tune.py's cuBLASLt
algorithms), kept across starts under the nanoserve cache dir (settings/env.py's ``cache_dir``: NANOSERVE_CACHE,
default ~/.cache/nanoserve), one JSON file per key in ``<cache_dir>/<kind>/<hash of the key>.json``.

The key names everything the choice depends on: the GPU (name, SMs, memory), the driver, torch and its CUDA, the
library's own version and a hash of the source files that make the choice, so a new driver or an edited tuner
recomputes instead of trusting an old answer. Deleting the directory is always safe: a missing, unreadable,
corrupt or foreign file (its stored key differs) is treated as empty and rewritten, and a directory that cannot be
written costs only the saving (one warning line), never the start."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

from settings.env import settings

FORMAT = 1  # of the file itself: a change of layout makes every old file foreign


def code_hash(modules: Iterable[ModuleType]) -> str:
    """sha256 (16 hex digits) over the source files of ``modules``: an edit to any of them is a new key."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def cuda_device_key(device) -> dict[str, str]:
    """What a tuned choice on ``device`` depends on besides the code: the GPU, its driver, torch and CUDA."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "sms": str(props.multi_processor_count),  # a MIG slice keeps its GPU's name, not its SM count
        "memory": str(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }


def _driver_version() -> str:
    try:  # the kernel module's version line names the driver release (e.g. 570.133.20)
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        pass
    try:  # else the CUDA driver API's version (e.g. 12080): coarser, still changes with the driver's CUDA
        import ctypes

        version = ctypes.c_int(0)
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return f"cuda-driver-api {version.value}"
    except (OSError, AttributeError):
        return "unknown"


class TuneCache:
    """One key's stored choices: ``get(name)`` / ``put(name, value)`` of JSON values, ``save()`` once at the end."""

    def __init__(self, kind: str, key: dict[str, str], root: Path | None = None) -> None:
        self.key = {"format": str(FORMAT), **key}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        self.path = (root if root is not None else settings().cache_dir) / kind / f"{digest}.json"
        self.entries = self._read()
        self.hits = self.misses = 0
        self.deferred = 0  # lookups its user left for a later start (a time budget ran out)
        self.dirty = False

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # missing, unreadable, not JSON (ValueError covers bad UTF-8 too)
            return {}
        if not isinstance(data, dict) or data.get("key") != self.key or not isinstance(data.get("entries"), dict):
            return {}  # another key's file under our name, or another layout: recompute, overwrite at save
        return data["entries"]

    def get(self, name: str):
        """The stored value of ``name``, or None."""
        return self.entries.get(name)

    def put(self, name: str, value) -> None:
        self.entries[name] = value
        self.dirty = True

    def drop(self, name: str) -> None:
        """Forget a stored value that did not pass its check (rewritten by the caller's ``put``)."""
        if self.entries.pop(name, None) is not None:
            self.dirty = True

    def lookup(self, name: str, compute: Callable[[], object], valid: Callable[[object], bool] = bool) -> object:
        """The stored value of ``name`` if ``valid`` accepts it, else ``compute()``'s, stored."""
        value = self.entries.get(name)
        if value is not None:
            try:
                ok = valid(value)
            except Exception:  # a damaged or hand-edited entry (any error checking it): recompute it
                ok = False
            if ok:
                self.hits += 1
                return value
            self.drop(name)
        self.misses += 1
        value = compute()
        self.put(name, value)
        return value

    def save(self) -> bool:
        """Write the file (atomically: a reader sees the old file or the new one) if anything changed; on a
        directory that cannot be written, one warning line and False."""
        if not self.dirty:
            return True
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": self.key, "entries": self.entries}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            print(f"nanoserve: warning: cannot write the tuning cache {self.path}: {e}", file=sys.stderr, flush=True)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        self.dirty = False
        return True
