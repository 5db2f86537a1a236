"""The tests' deadlines. Each one only stops a hang, never measures speed: the suite runs beside other work on
two cores (a second copy of itself, other builds), where a step, a process start or a teardown takes many times
its idle time. So they are generous, and one factor scales them all for a slower host."""

from __future__ import annotations

import os

# a test-only knob (the product's settings are read in settings/env.py): e.g. 2 under a debugger or emulation
TIMEOUT_SCALE = float(os.environ.get("NANOSERVE_TEST_TIMEOUT_SCALE", "1") or 1)


def bound(seconds: float) -> float:
    """``seconds`` scaled by ``TIMEOUT_SCALE``: for a deadline that only stops a hang."""
    return seconds * TIMEOUT_SCALE


HANG_S = bound(120)  # a request, a reply, a process exit or a condition polled for: 120 s means it hangs
START_S = bound(300)  # a server or worker start-up (imports torch, writes and loads a model): the slowest wait
