"""A server command in a subprocess whose stdout announces where it listens: the tests' launch.py and
``nanoserve serve`` processes share how they start, wait for those lines and stop."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from benchmarks.pipe_lines import PipeLines
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

LISTENING = "nanoserve listening on "  # launch.py's ZMQ address line
OPENAI_API = "nanoserve OpenAI API on "  # the HTTP front-end's line; its 5th word is the base URL


class AnnouncedProcess:
    """``cmd`` with its stderr in ``log_path``, read until a stdout line starts with each prefix in ``wanted``
    (``words[prefix]``: that line's words). Always ``stop()`` it (or leave a ``with`` block)."""

    def __init__(self, cmd: list[str], log_path: Path, wanted: tuple[str, ...], timeout: float = START_S, **popen):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=self.log, text=True, **popen,
        )  # fmt: skip
        self.lines: list[str] = []
        self.words: dict[str, list[str]] = {}
        reader = PipeLines(self.proc.stdout)
        deadline = time.monotonic() + timeout
        try:
            while len(self.words) < len(wanted):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(cmd[1:3])} did not start:\n{self.stderr()}")
                for line in reader.poll(0.2):
                    self.lines.append(line)
                    self.words.update((p, line.split()) for p in wanted if line.startswith(p))
        except BaseException:
            self.stop()
            raise
        finally:
            reader.close()

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int:
        """SIGTERM (a graceful stop drains first), SIGKILL only if that hangs; the exit code."""
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
