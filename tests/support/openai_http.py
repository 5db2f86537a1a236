"""A nanoserve HTTP server in a subprocess for tests: ``python launch.py --port 0 --http-port 0 ...``."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.announced import LISTENING, OPENAI_API, AnnouncedProcess
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S

ENGINE_ARGS = [
    "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "128",
    "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
]  # fmt: skip


class HttpServer(AnnouncedProcess):
    """``python launch.py --port 0 --http-port 0 ...``: both lines read from its stdout. Always ``stop()`` it
    (or leave a ``with`` block). ``new_session``: it leads its own process group, as a terminal's job does."""

    def __init__(
        self, model_dir, log_path: Path, *extra: str, timeout: float = START_S, new_session: bool = False
    ) -> None:
        cmd = [sys.executable, str(ROOT / "launch.py"), "--port", "0", "--http-port", "0", "--model", str(model_dir)]
        wanted = (LISTENING, OPENAI_API)
        super().__init__([*cmd, *ENGINE_ARGS, *extra], log_path, wanted, timeout, start_new_session=new_session)
        self.zmq, self.base_url = self.words[LISTENING][-1], self.words[OPENAI_API][4]
        self.root = self.base_url.removesuffix("/v1")


def http_get(url: str, **kw) -> httpx.Response:
    """``httpx.get`` with the tests' hang bound: httpx's own default (5 s) is short for a busy host."""
    return httpx.get(url, **{"timeout": HANG_S, **kw})


def http_post(url: str, **kw) -> httpx.Response:
    """``httpx.post`` with the tests' hang bound."""
    return httpx.post(url, **{"timeout": HANG_S, **kw})


def metrics(server) -> dict:
    """Every sample of /metrics, parsed by prometheus_client: {(name, sorted labels): value}."""
    text = httpx.get(server.root + "/metrics", timeout=HANG_S).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def metric(server, name: str, **labels) -> float:
    return metrics(server).get((name, tuple(sorted(labels.items()))), 0.0)
