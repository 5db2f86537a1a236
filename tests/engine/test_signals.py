"""An ``LLM()`` script stopped by a signal: it ends as the signal says and leaves no files behind; after a kill -9,
the next engine removes what it left."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.processes import ROOT, children_of, wait_gone
from tests.support.timeouts import HANG_S

SCRIPT = """
import sys, time
from nanoserve import LLM
llm = LLM(sys.argv[1], device="cpu", max_model_len=128, num_kv_blocks=16)
print("ready", flush=True)
time.sleep(600)
"""


def test_sigterm_leaves_no_files_behind(tiny_tied, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))  # where tempfile puts the worker group's private dir
    cmd = [sys.executable, "-c", SCRIPT, str(tiny_tied)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        workers = children_of(proc.pid)
        assert workers and list(tmp.glob("nanoserve-*")), "the engine's private dir should exist while it runs"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_S) == -signal.SIGTERM
        assert list(tmp.glob("nanoserve-*")) == []
        assert wait_gone(workers, HANG_S)
    finally:
        proc.kill()
        proc.wait()


def test_sigkill_leaves_a_dir_that_the_next_engine_removes(tiny_tied):
    # kill -9 runs no cleanup at all: the dir stays until the next engine on this host starts, which removes it
    # (its owner is gone) and leaves a live engine's alone
    tmp = Path(tempfile.mkdtemp(prefix="signals-", dir="/tmp"))  # short: the worker socket's path must fit
    env = dict(os.environ, TMPDIR=str(tmp))
    cmd = [sys.executable, "-c", SCRIPT, str(tiny_tied)]
    procs = []
    try:
        dirs = []
        for _ in range(2):
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert proc.stdout.readline().strip() == "ready"
            (new,) = set(tmp.glob("nanoserve-*")) - set(dirs)
            dirs.append(new)
        live, killed = procs
        live_dir, killed_dir = dirs
        workers = children_of(killed.pid)
        killed.kill()
        assert killed.wait(HANG_S) == -signal.SIGKILL
        assert wait_gone(workers, HANG_S)  # they die with their coordinator
        assert killed_dir.exists()
        nxt = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        procs.append(nxt)
        assert nxt.stdout.readline().strip() == "ready"
        assert not killed_dir.exists() and live_dir.exists()
        for proc in (live, nxt):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(HANG_S) == -signal.SIGTERM
        assert list(tmp.iterdir()) == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        shutil.rmtree(tmp, ignore_errors=True)
