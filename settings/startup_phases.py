"""Where a process's start-up time goes: each phase's seconds, from the process's own start (the interpreter and
the imports included) to ready, reported as one line on stderr (``nanoserve[startup] WHO ready in T s: phase s,
...``): each worker rank's at its ready, the coordinator's once it listens (benchmarks/startup.py reads them). Here,
the lowest layer, because every process keeps one; no torch: the clock starts before it loads."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

PREFIX = "nanoserve[startup]"


def process_age_s() -> float:
    """Seconds since this process was created (Linux: /proc, 10 ms ticks); 0.0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces: cut after it
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return 0.0


class StartupPhases:
    """Seconds per named phase, in the order first seen; ``mark(name)`` books the time since the last mark."""

    def __init__(self, age_s: float = 0.0) -> None:
        self.started = time.perf_counter() - age_s
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}
        if age_s > 0:
            self.seconds["python"] = age_s  # interpreter start up to the first line of ours

    def mark(self, name: str) -> float:
        """Book the time since the last mark (or phase end) to ``name``; returns it."""
        now = time.perf_counter()
        took = now - self.last
        self.seconds[name] = self.seconds.get(name, 0.0) + took
        self.last = now
        return took

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Book the block's time to ``name`` (what came before it, since the last mark, goes to "other")."""
        if time.perf_counter() - self.last > 0.005:
            self.mark("other")
        try:
            yield
        finally:
            self.mark(name)

    def total_s(self) -> float:
        return time.perf_counter() - self.started

    def line(self, who: str) -> str:
        """``nanoserve[startup] WHO ready in T s (cpu C s): name s, ...`` (one line, parsed by benchmarks/startup.py).
        C is the process's own CPU time so far: on a host busy with other work, the wall times grow, it does not."""
        parts = ", ".join(f"{name} {s:.2f}" for name, s in self.seconds.items())
        return f"{PREFIX} {who} ready in {self.total_s():.2f} s (cpu {time.process_time():.2f} s): {parts}"

    def report(self, who: str) -> None:
        """Write ``line(who)`` to stderr in one write: ranks share the pipe, and print's two writes (text, then
        newline, each its own under PYTHONUNBUFFERED) let another process's line land between them."""
        sys.stderr.write(self.line(who) + "\n")
        sys.stderr.flush()


def parse_line(line: str) -> tuple[str, float, dict[str, float]] | None:
    """(who, total seconds, phases and "cpu") of a ``line`` written by ``StartupPhases.line``, or None."""
    start = line.find(PREFIX)
    if start < 0 or " ready in " not in line:
        return None
    head, _, tail = line[start + len(PREFIX) :].partition(" s): ")
    who, _, times = head.strip().rpartition(" ready in ")
    try:
        total, _, cpu = times.partition(" s (cpu ")
        phases = {"cpu": float(cpu)}
        for part in filter(None, (p.strip() for p in tail.split(","))):
            name, _, value = part.rpartition(" ")
            phases[name] = float(value)
        return who, float(total), phases
    except ValueError:
        return None


PHASES = StartupPhases(process_age_s())  # this process's, counted from its start: import this module early
