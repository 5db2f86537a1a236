"""coordinator/private_dirs.py with real processes: a dir whose owner was SIGKILLed is swept by the next
``create()``, a live process's dir never is (nor one whose owner is still being written, nor a young or non-empty
one without an owner file), and a pid that names a live process does not keep a dir whose lock nobody holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from coordinator import private_dirs
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S

HOLDER = """
import sys
from coordinator import private_dirs
print(private_dirs.create(), flush=True)
sys.stdin.read()  # until the test closes our stdin (or kills us)
"""


def _holder(tmp: Path) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_owners_dir_is_swept_and_a_live_ones_is_kept(tmp_path):
    live, live_dir = _holder(tmp_path)
    killed, killed_dir = _holder(tmp_path)
    try:
        assert live_dir.parent == tmp_path and (live_dir / "owner").read_text().split()[0] == str(live.pid)
        killed.kill()
        killed.wait(HANG_S)
        assert killed_dir.exists()  # SIGKILL: no cleanup ran
        ours = private_dirs.create(str(tmp_path))  # sweeps first
        try:
            assert not killed_dir.exists() and live_dir.exists()
            assert sorted(tmp_path.iterdir()) == sorted([live_dir, Path(ours)])
            assert private_dirs.sweep(str(tmp_path)) == []  # our own dir, locked by us, stays too
        finally:
            private_dirs.remove(ours)
        assert not Path(ours).exists()
        live.stdin.close()
        assert live.wait(HANG_S) == 0
        assert live_dir.exists()  # it ended without remove(): the next sweep takes it
        assert private_dirs.sweep(str(tmp_path)) == [str(live_dir)]
    finally:
        for proc in (live, killed):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_dirs_it_cannot_judge_are_left_alone(tmp_path):
    no_owner = tmp_path / "nanoserve-old"  # an older version's dir, or one whose owner file is not made yet
    no_owner.mkdir()
    being_made = tmp_path / "nanoserve-new"  # created, not yet locked and written
    being_made.mkdir()
    (being_made / "owner").touch()
    other = tmp_path / "unrelated"
    other.mkdir()
    (other / "owner").write_text("1 1\n")
    assert private_dirs.sweep(str(tmp_path)) == []
    assert no_owner.exists() and being_made.exists() and other.exists()


def test_a_live_pid_without_the_lock_does_not_keep_a_dir(tmp_path):
    # a recycled pid: the owner file names a live process (this one), but no process holds its lock
    stale = tmp_path / "nanoserve-recycled"
    stale.mkdir()
    (stale / "owner").write_text(f"{os.getpid()} 1\n")
    assert private_dirs.sweep(str(tmp_path)) == [str(stale)]
    assert not stale.exists()


def test_sigterm_removes_the_dirs_first(tmp_path):
    proc, path = _holder(tmp_path)
    try:
        assert path.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_S) == -signal.SIGTERM  # it still dies of the signal
        assert not path.exists()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_an_old_empty_dir_without_owner_is_removed(tmp_path):
    # an older version's leftover with nothing in it: no process can be using it; a young one may be mid-creation
    old, young = tmp_path / "nanoserve-old", tmp_path / "nanoserve-young"
    old.mkdir()
    young.mkdir()
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    assert private_dirs.sweep(str(tmp_path)) == [str(old)]
    assert not old.exists() and young.exists()
