"""An ``LLM()`` script stopped by a signal: it ends as the signal says and leaves no files behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support.processes import ROOT, children_of, wait_gone

SCRIPT = """
import sys, time
from client import LLM
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
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert list(tmp.glob("nanoserve-*")) == []
        assert wait_gone(workers, 60)
    finally:
        proc.kill()
        proc.wait()
