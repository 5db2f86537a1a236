"""Two hosts on one box: the server and worker rank 0 in one network namespace, rank 1 in another, joined by a
veth pair. Rank 1 reaches the coordinator, and the gloo rendezvous and collectives reach rank 0, over real TCP
between two addresses; both ranks prove they hold the worker secret, which they take from their environment as
torchrun workers do. TP=2 greedy output equals TP=1's. Then the faults: the link goes down mid-stream, or loses
and delays packets (tc netem): the client gets a clear error (or, under loss, its whole answer) in bounded time,
every process ends by itself, and no namespace, process or /tmp/nanoserve-* directory is left behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import netns
from tests.support.processes import ROOT, wait_for_text

SECRET = "multihost-secret"
CLIENT_PORT, WORKER_PORT, STORE_PORT = 8765, 29600, 29500  # inside fresh namespaces: always free
COORDINATOR = f"tcp://{netns.ADDRESSES['a']}:{WORKER_PORT}"
ENGINE = ["--max-model-len", "256", "--num-kv-blocks", "64", "--dtype", "float32", "--enforce-eager"]
MAX_TOKENS = 10
LONG_STREAM = 200  # tokens: the fault arrives while it streams

pytestmark = pytest.mark.skipif(bool(why := netns.unavailable()), reason=why or "")


def _prompts() -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(5)
    return [rng.integers(0, 400, n).tolist() for n in (7, 30, 1, 19)]


@pytest.fixture(scope="module")
def tp1_tokens(tiny_untied) -> list[list[int]]:
    from nanoserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine_args = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, enforce_eager=True, device="cpu")
    with LLM(str(tiny_untied), tensor_parallel_size=1, **engine_args) as llm:
        return [c.token_ids for c in llm.generate(_prompts(), params, use_tqdm=False)]


def _env(tmp: Path, **extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp), **extra)
    for name in ("NANOSERVE_API_KEY", "NANOSERVE_WORKER_SECRET", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    env.update(extra)
    return env


class Cluster:
    """The server (launch.py) and rank 0 on side a, rank 1 on side b; logs under ``tmp``."""

    def __init__(self, net: netns.NetnsPair, model: Path, tmp: Path) -> None:
        self.net, self.tmp = net, tmp
        (tmp / "tmp").mkdir()
        server_cmd = [sys.executable, "launch.py", "--host", "127.0.0.1", "--port", str(CLIENT_PORT), "--model"]
        server_cmd += [str(model), "--device", "cpu", "--tp", "2", "--external-workers", "--worker-address"]
        server_cmd += [COORDINATOR, "--worker-timeout-s", "300", *ENGINE]
        self.server = self._start("a", server_cmd, "server", NANOSERVE_API_KEY=SECRET)  # the API key implies it
        self.workers = [self._worker(rank, side) for rank, side in ((0, "a"), (1, "b"))]

    def _start(self, side: str, argv: list[str], name: str, **env: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        env = _env(self.tmp / "tmp", **env)
        with log:
            cmd = self.net.cmd(side, argv)
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def _worker(self, rank: int, side: str) -> subprocess.Popen:
        env = dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.update(MASTER_ADDR=netns.ADDRESSES["a"], MASTER_PORT=str(STORE_PORT), GLOO_SOCKET_IFNAME=self.net.dev[side])
        argv = [sys.executable, "-m", "worker", "--coordinator", COORDINATOR]
        return self._start(side, argv, f"rank{rank}", NANOSERVE_WORKER_SECRET=SECRET, **env)

    def client(self, mode: str, max_tokens: int, prompts) -> subprocess.Popen:
        argv = [sys.executable, "-m", "tests.tensor_parallel.netns_client", f"tcp://127.0.0.1:{CLIENT_PORT}"]
        argv += [mode, str(max_tokens), json.dumps(prompts)]
        env = _env(self.tmp / "tmp", NANOSERVE_API_KEY=SECRET)
        return subprocess.Popen(self.net.cmd("a", argv), cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def processes(self) -> list[subprocess.Popen]:
        return [self.server, *self.workers]


@contextlib.contextmanager
def _cluster(model: Path, tmp: Path):
    with netns.NetnsPair() as net:
        cluster = Cluster(net, model, tmp)
        try:
            wait_for_text(tmp / "server.log", "nanoserve listening", cluster.server, timeout=300)
            yield cluster
        finally:
            for proc in cluster.processes():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)
    assert not net.exists(), "a namespace was left behind"
    assert not list((tmp / "tmp").glob("nanoserve-*")), "the server left its private directory behind"


def _lines(proc: subprocess.Popen, timeout: float) -> list[dict]:
    out, _ = proc.communicate(timeout=timeout)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _stream_under_fault(cluster: Cluster, fault, bound_s: float) -> tuple[list[dict], float]:
    """A long greedy stream; ``fault()`` once a few tokens have arrived. The events, and seconds from the fault to
    the stream's end."""
    client = cluster.client("stream", LONG_STREAM, _prompts()[1])
    events = []
    for line in client.stdout:
        events.append(json.loads(line))
        if events[-1].get("delta", 0) >= 3:
            break
    assert events and "delta" in events[-1], f"{events}\n{cluster.logs()}"
    fault()
    t0 = time.monotonic()
    events += _lines(client, timeout=bound_s)  # bounded: raises TimeoutExpired rather than hang
    return events, time.monotonic() - t0


def _ends_by_itself(cluster: Cluster, timeout: float) -> None:
    """Every process of the service exits on its own (the server once asked): none hangs on a lost peer."""
    if cluster.server.poll() is None:
        cluster.server.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    for proc in cluster.processes():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"pid {proc.pid} still runs {timeout:g} s after the fault\n{cluster.logs()}")
    print(f"every process ended {time.monotonic() - t0:.1f} s after the server was asked to stop")
    assert not cluster.net.pids(), "a process is left in a namespace"


def test_tp2_across_two_hosts_matches_tp1_and_a_lost_link_fails_fast(tiny_untied, tp1_tokens, tmp_path):
    with _cluster(tiny_untied, tmp_path) as cluster:
        (result,) = _lines(cluster.client("greedy", MAX_TOKENS, _prompts()), timeout=300)
        assert result.get("tokens") == tp1_tokens, f"{result}\n{cluster.logs()}"
        for rank in (0, 1):  # both ranks proved the secret: no refusals
            assert "refused" not in (tmp_path / f"rank{rank}.log").read_text()

        events, took = _stream_under_fault(cluster, cluster.net.link_down, bound_s=120)
        last = events[-1]
        assert "error" in last, f"the stream did not fail: {last}\n{cluster.logs()}"
        # rank 1's heartbeats stop: the coordinator drops it within HEARTBEAT_TIMEOUT_MS (5 s), then fails the stream
        assert "rank 1" in last["error"] or "worker" in last["error"], last
        print(f"link down -> client error in {took:.1f} s")
        _ends_by_itself(cluster, timeout=60)


def test_tp2_across_two_hosts_under_loss_and_delay(tiny_untied, tp1_tokens, tmp_path):
    with netns.NetnsPair() as probe:  # before any process starts: kernels without sch_netem skip at once
        if why := probe.netem("loss 30% delay 200ms"):
            pytest.skip(why)
    with _cluster(tiny_untied, tmp_path) as cluster:
        assert not cluster.net.netem("loss 30% delay 200ms")
        # every step's all-reduces cross the impaired link (200 ms more each way): a short answer
        t0 = time.monotonic()
        events = _lines(cluster.client("stream", MAX_TOKENS, _prompts()[1]), timeout=300)
        took = time.monotonic() - t0
        last = events[-1]
        if "error" in last:  # a heartbeat lapsed past 5 s: a clear error, in bounded time
            assert "worker" in last["error"] or "rank" in last["error"], last
        else:  # or the whole answer, exactly TP=1's
            assert last.get("finish") == "length" and last["tokens"] == tp1_tokens[1], last
        print(f"loss 30% + delay 200 ms: {'error' if 'error' in last else 'answer'} in {took:.1f} s")
        _ends_by_itself(cluster, timeout=120)
