"""Private temporary directories (the worker socket, the gloo file store) that never outlive their process.

``create()`` makes ``nanoserve-XXXX`` in the temp dir (``TMPDIR`` honoured) holding an ``owner`` file that the
creating process keeps flock-ed for as long as it lives: the kernel drops the lock when the process ends, however
it ends (kill -9 included). Each ``create()`` first sweeps the temp dir: a ``nanoserve-*`` dir whose owner lock
can be taken belonged to a process that is gone, and is removed. A lock, not a pid: a recycled pid, or a server
in another pid namespace sharing /tmp, cannot make a live dir look dead. A dir with no owner file (an older
version's, or one being created this very moment) is removed only when it is empty and a minute old.

``remove()`` deletes one at shutdown; SIGTERM/SIGHUP, which run no atexit hook, remove the live dirs first where
nobody else handles those signals.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("nanoserve.private_dirs")

PREFIX = "nanoserve-"
OWNER = "owner"
FATAL_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
OWNERLESS_GRACE_S = 60.0
_live: dict[str, int] = {}  # this process's dirs -> the descriptor holding each one's lock
_lock = threading.Lock()


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), for the owner file's reader."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def create(temp_root: str | None = None) -> str:
    """A new private dir, owned (locked) by this process until ``remove()`` or its end; stale ones swept first."""
    sweep(temp_root)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=temp_root)
    fd = os.open(os.path.join(path, OWNER), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # never blocks: the file is new and ours
    pid = os.getpid()
    # written only once locked: a sweeper that finds the lock free and the file empty knows creation is under way
    os.write(fd, f"{pid} {_start_time(pid)}\n".encode())
    with _lock:
        _live[path] = fd
    _watch_fatal_signals(True)
    return path


def remove(path: str) -> None:
    """Delete one of this process's private dirs (idempotent); its lock goes with it."""
    shutil.rmtree(path, ignore_errors=True)
    with _lock:
        fd = _live.pop(path, None)
        last = not _live
    if fd is not None:
        os.close(fd)
    if last:
        _watch_fatal_signals(False)


def _owner_gone(owner: Path) -> str | None:
    """The dead owner's "pid start-time" when no live process holds ``owner``'s lock, else None."""
    try:
        fd = os.open(owner, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None  # no owner file (being created, or an older version's dir): not ours to judge
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return None  # held: its process is alive
        text = os.read(fd, 64).decode(errors="replace").strip()
        return text or None  # empty: its creator is between creating and locking it
    finally:
        os.close(fd)  # drops our lock


def sweep(temp_root: str | None = None) -> list[str]:
    """Remove every ``nanoserve-*`` dir in the temp dir whose owner process is gone; returns the removed paths."""
    root = Path(temp_root or tempfile.gettempdir())
    removed = []
    uid = os.getuid()
    for path in root.glob(PREFIX + "*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != uid:
                continue  # another user's, or not a dir we make
        except OSError:
            continue
        if not os.path.lexists(path / OWNER):
            if _remove_if_old_and_empty(path):
                removed.append(str(path))
            continue
        owner = _owner_gone(path / OWNER)
        if owner is None or str(path) in _live:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
        log.info("removed %s, left behind by process %s (pid, start time), which is gone", path, owner)
    return removed


def _remove_if_old_and_empty(path: Path) -> bool:
    """An ownerless dir (an older version's) with nothing in it, untouched for a while: no process can be using it,
    and one just made by ``create()`` gets its owner file within microseconds."""
    try:
        if time.time() - path.stat().st_mtime < OWNERLESS_GRACE_S:
            return False
        os.rmdir(path)  # fails unless empty
    except OSError:
        return False
    log.info("removed %s, an empty private dir with no owner", path)
    return True


def _remove_all_then_die(signum, frame) -> None:
    for path in list(_live):
        shutil.rmtree(path, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal as before (the kernel then ends spawned workers)


def _watch_fatal_signals(on: bool) -> None:
    """A process killed by SIGTERM/SIGHUP runs no atexit hook: where nobody else handles those signals, remove the
    dirs first (``on``), and stop once no dir is left."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    for sig in FATAL_SIGNALS:
        current = signal.getsignal(sig)
        if on and current is signal.SIG_DFL:
            signal.signal(sig, _remove_all_then_die)
        elif not on and current is _remove_all_then_die:
            signal.signal(sig, signal.SIG_DFL)
