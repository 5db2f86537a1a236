"""Two network namespaces joined by a veth pair, as two hosts on one box: side "a" (10.231.0.1) and side "b"
(10.231.0.2). Needs root (``ip netns add``); ``unavailable()`` says why not, for a skip. Everything is removed on
exit: the processes still in either namespace are killed first, then the namespaces (which takes the link)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ADDRESSES = {"a": "10.231.0.1", "b": "10.231.0.2"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    name = f"nsprobe{os.getpid()}"
    try:
        out = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no usable `ip` command: {e}"
    if out.returncode != 0:
        return f"`ip netns add` failed (root and a kernel with network namespaces needed): {out.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class NetnsPair:
    """``with NetnsPair() as net: net.cmd("a", [...])``; names are unique to this process (parallel runs)."""

    def __init__(self) -> None:
        tag = f"nsv{os.getpid() % 10**6}"
        self.ns = {side: f"{tag}{side}" for side in "ab"}
        self.dev = dict(self.ns)  # each side's end of the link is named as its namespace

    def __enter__(self) -> NetnsPair:
        try:
            for side in "ab":
                _ip("netns", "add", self.ns[side])
            _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
            for side in "ab":
                ns, dev = self.ns[side], self.dev[side]
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ADDRESSES[side]}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cmd(self, side: str, argv: list[str]) -> list[str]:
        """``argv`` run inside that side's namespace (the process ``ip`` runs is ``argv`` itself: same pid)."""
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def link_down(self) -> None:
        _ip("-n", self.ns["a"], "link", "set", self.dev["a"], "down")

    def netem(self, spec: str) -> str | None:
        """Impair side a's end of the link (``tc ... netem SPEC``, e.g. "loss 30% delay 200ms"); why not, or None."""
        argv = ["tc", "qdisc", "add", "dev", self.dev["a"], "root", "netem", *spec.split()]
        out = subprocess.run(self.cmd("a", argv), capture_output=True, text=True, timeout=30)
        return None if out.returncode == 0 else f"tc netem unavailable here: {(out.stderr or out.stdout).strip()}"

    def pids(self) -> list[int]:
        found = []
        for ns in self.ns.values():
            out = _ip("netns", "pids", ns, check=False)
            found += [int(p) for p in out.stdout.split()]
        return found

    def close(self) -> None:
        deadline = time.monotonic() + 30
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for ns in self.ns.values():
            if Path(f"/run/netns/{ns}").exists():
                _ip("netns", "del", ns, check=False)

    def exists(self) -> bool:
        return any(Path(f"/run/netns/{ns}").exists() for ns in self.ns.values())
