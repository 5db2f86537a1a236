"""The installed ``nanoserve`` console script (next to this interpreter; ``python -m nanoserve.cli`` where it is not
installed), and a ``nanoserve serve`` server in a subprocess for the tests that talk to one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.announced import OPENAI_API, AnnouncedProcess
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S

_SCRIPT = Path(sys.executable).parent / "nanoserve"
NANOSERVE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "nanoserve.cli"]


def nanoserve(*args: str, stdin: str | None = None, env: dict | None = None, cwd: Path = ROOT, timeout=HANG_S):
    """Run ``nanoserve ARGS`` to its end."""
    return subprocess.run(
        [*NANOSERVE, *args],
        cwd=cwd,
        input=stdin if stdin is not None else "",
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def imported_torch(stderr: str) -> bool:
    """Whether a run under PYTHONPROFILEIMPORTTIME=1 imported torch (its import-time lines name every module)."""
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in stderr.splitlines())


class ServeProcess(AnnouncedProcess):
    """``nanoserve serve ARGS``; ``base_url`` from the front-end's "OpenAI API on" line. Always ``stop()`` it."""

    def __init__(self, *args: str, log_path: Path) -> None:
        super().__init__([*NANOSERVE, "serve", *args], log_path, (OPENAI_API,))
        self.base_url = self.words[OPENAI_API][4]
