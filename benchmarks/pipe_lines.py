"""A child process's output lines as they come, for the tools and tests that wait for a server's ready lines."""

from __future__ import annotations

import os
import selectors


class PipeLines:
    """A child's output lines as they come, read from its pipe's descriptor (``os.read``), never through the file
    object's ``readline``: that reads ahead, so a line that arrived in one read with the one before it would wait
    in its buffer, unseen by ``select``, until the next output or the caller's deadline."""

    def __init__(self, pipe) -> None:
        self.fd, self.ended, self._rest = pipe.fileno(), False, b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.fd, selectors.EVENT_READ)

    def poll(self, timeout: float) -> list[str]:
        """The lines completed within ``timeout`` seconds (often none), each with its newline; at the end of the
        output, what is left and ``ended``."""
        if self.ended or not self._sel.select(timeout):
            return []
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            self.ended, rest, self._rest = True, self._rest, b""
            return [rest.decode(errors="replace")] if rest else []
        *lines, self._rest = (self._rest + chunk).split(b"\n")
        return [line.decode(errors="replace") + "\n" for line in lines]

    def close(self) -> None:
        self._sel.close()
