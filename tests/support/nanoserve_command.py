"""The installed ``nanoserve`` console script (next to this interpreter; ``python -m nanoserve.cli`` where it is not
installed), and a ``nanoserve serve`` server in a subprocess for the tests that talk to one."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

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


class ServeProcess:
    """``nanoserve serve ARGS``; ``base_url`` from the front-end's "OpenAI API on" line. Always ``stop()`` it."""

    def __init__(self, *args: str, log_path: Path) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [*NANOSERVE, "serve", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lines: list[str] = []
        self.base_url = None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_S
        try:
            while self.base_url is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nanoserve serve did not start:\n{log_path.read_text()}")
                if sel.select(0.2):
                    line = self.proc.stdout.readline()
                    self.lines.append(line)
                    if line.startswith("nanoserve OpenAI API on "):
                        self.base_url = line.split()[4]
        except BaseException:
            self.stop()
            raise
        finally:
            sel.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(HANG_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        return code
