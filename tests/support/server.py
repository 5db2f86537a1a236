"""A ``python launch.py`` server in a subprocess, and the small CPU engine every server test runs."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from client import Client, SamplingParams
from protocol.client_messages import CLIENT_PROTOCOL_VERSION, Generate
from tests.support.announced import LISTENING, AnnouncedProcess
from tests.support.processes import ROOT, children_of
from tests.support.timeouts import HANG_S, START_S

ENGINE_ARGS = [
    "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256",
    "--max-num-seqs", "64", "--max-num-batched-tokens", "1024",
]  # fmt: skip
ENGINE_KWARGS = dict(
    device="cpu", dtype="float32", max_model_len=1024, num_kv_blocks=256, max_num_seqs=64, max_num_batched_tokens=1024
)


MAX_PENDING = 300  # the ZMQ serving tests' server: --max-pending-requests
MAX_MESSAGE_BYTES = 1 << 20  # and --max-message-bytes


def wait_stats(client, cond, timeout: float = HANG_S) -> dict:
    """The server's stats once ``cond(stats)`` holds, or at ``timeout`` seconds (only a hang reaches it)."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if cond(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def generate_frame(rid: str, **kw) -> Generate:
    """A Generate frame; keyword arguments override its fields or its params' (set after construction, so that
    bad values reach the wire unvalidated)."""
    msg = Generate(CLIENT_PROTOCOL_VERSION, rid, None, "hello", False, SamplingParams(temperature=0.0, max_tokens=4))
    for name, value in kw.items():
        setattr(msg if hasattr(msg, name) and name != "params" else msg.params, name, value)
    return msg


class ServerProcess(AnnouncedProcess):
    """``python launch.py --port 0 ...``; ``address`` from its "listening" line. Always ``stop()`` it
    (or leave a ``with`` block)."""

    def __init__(self, model_dir, log_path: Path, *extra: str, timeout: float = START_S) -> None:
        cmd = [sys.executable, str(ROOT / "launch.py"), "--port", "0", "--model", str(model_dir), *ENGINE_ARGS]
        super().__init__([*cmd, *extra], log_path, (LISTENING,), timeout)
        self.address = self.words[LISTENING][-1]
        self.workers = children_of(self.proc.pid)

    def stop(self) -> int:
        """As AnnouncedProcess.stop, and any worker left is killed (a graceful exit removes its socket files)."""
        pids = children_of(self.proc.pid) if self.proc.poll() is None else []
        code = super().stop()
        for pid in pids + getattr(self, "workers", []):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return code


def some_prompts(n: int = 16, seed: int = 3) -> list:
    """``n`` prompts, alternately text (words including non-ASCII) and random token ids of 1-69 tokens."""
    rng = np.random.default_rng(seed)
    words = ["def", "class", "return", "import os", "hello", "the quick brown fox", "for i in range(", "Ünïcödé ✓"]
    prompts: list = []
    for i in range(n):
        if i % 2:
            prompts.append(rng.integers(3, 500, int(rng.integers(1, 70))).tolist())
        else:
            prompts.append(" ".join(rng.choice(words, int(rng.integers(1, 8)))))
    return prompts


def generate_in_thread(address: str, prompt, params: SamplingParams, out: dict, token: str | None = None):
    """A non-streamed request from a client of its own, on a started thread: ``out`` gets its "completion", or the
    "error" it raised (what a server fault or shutdown tells a waiting caller)."""

    def run() -> None:
        with Client(address, timeout=HANG_S, token=token) as c:
            try:
                out["completion"] = c.generate(prompt, params)
            except Exception as e:
                out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t
