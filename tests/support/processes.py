"""Real processes for tests: the repository root they run in, free ports, torchrun command lines, and /proc
look-ups (no psutil)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    # Only for the test's private endpoints; the coordinator binds it right away (ZMQ fails loudly if taken).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(tp: int, module: str, *args: str) -> list[str]:
    """``torchrun --nproc-per-node TP -m MODULE ARGS`` on loopback; run it with cwd=ROOT (``-m`` finds MODULE there)."""
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    base = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return [*base, "--nproc-per-node", str(tp), *rendezvous, "-m", module, *args]


def sigint_default() -> None:
    """A ``preexec_fn``: the child starts with SIGINT's default action, as a terminal's foreground job does. Under
    ``nohup ... &``, a non-interactive shell's background job or many CI runners SIGINT is ignored from the start,
    and a program rightly keeps an ignored SIGINT ignored; a test of Ctrl-C must not inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (no psutil)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def wait_for_text(log_path: Path, text: str, proc, timeout: float = 300) -> None:
    """Until ``text`` appears in the file ``proc`` writes; fails at once if ``proc`` exits first (the timeout only
    stops a hang)."""
    deadline = time.monotonic() + timeout
    while text not in log_path.read_text():
        assert proc.poll() is None, f"exited with {proc.returncode} before saying {text!r}:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{log_path.read_text()}"
        time.sleep(0.05)
