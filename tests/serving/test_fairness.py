"""Fairness between ZMQ clients: one client's burst over --max-pending-per-client is refused (Overloaded naming the
limit) while another client is served in full; a client killed (or stopped) with its requests in flight has them
aborted and their KV blocks freed once its heartbeat lapses (--client-heartbeat-timeout); a live client that does
not read for a while keeps its requests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from client import AsyncClient, Client, OverloadedError, SamplingParams
from tests.support.processes import ROOT
from tests.support.server import ServerProcess, wait_stats
from tests.support.timeouts import HANG_S

PER_CLIENT = 16
HEARTBEAT_TIMEOUT_S = 8  # short, for the test; still many keep-alives (1 s) apart on a loaded host
# one sequence at a time, so that a client's long requests stay pending for a long while even on a fast idle machine
FLAGS = [
    "--max-pending-requests", "64", "--max-pending-per-client", str(PER_CLIENT),
    "--client-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--max-num-seqs", "1",
]  # fmt: skip
LONG = SamplingParams(max_tokens=1000, ignore_eos=True)  # ~1000 steps each, one after the other
DEADLINE_S = 90  # for what the server does on its own: generous, the machine may be busy


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    with ServerProcess(tiny_tied, tmp_path_factory.mktemp("fairness") / "server.log", *FLAGS) as srv:
        yield srv


def _idle(c: Client) -> dict:
    s = wait_stats(c, lambda s: s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"], DEADLINE_S)
    assert s["pending"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"], s
    return s


def test_info_names_the_limits(server):
    with Client(server.address, timeout=HANG_S) as c:
        info = c.info()
    assert info["max_pending_per_client"] == PER_CLIENT
    assert info["client_heartbeat_timeout_s"] == HEARTBEAT_TIMEOUT_S


def test_a_burst_over_the_per_client_limit_leaves_room_for_others(server):
    with Client(server.address, timeout=HANG_S) as a, Client(server.address, timeout=HANG_S) as b:
        before = _idle(a)
        burst = [a.stream([7] * 8, LONG) for _ in range(PER_CLIENT + 24)]
        # one connection is FIFO: the Stats reply comes after every Generate of the burst was handled
        s = a.stats()
        assert s["pending"] == PER_CLIENT
        assert s["requests_rejected_per_client"] - before["requests_rejected_per_client"] == 24
        for st in burst[PER_CLIENT:]:
            with pytest.raises(OverloadedError, match=f"per-client limit \\(--max-pending-per-client {PER_CLIENT}\\)"):
                next(st)
        # a second client gets every request in while the first is at its limit
        others = [b.stream([9] * 4, SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(8)]
        assert b.stats()["pending"] == PER_CLIENT + 8
        # a label within one connection (the HTTP front-end's users) is a client of its own
        labelled = [a.stream([5] * 4, LONG, client="user-2") for _ in range(4)]
        assert a.stats()["pending"] == PER_CLIENT + 12
        for st in burst + labelled:
            st.close()  # the first client leaves: the second's requests run now
        for st in others:
            deltas = list(st)
            assert deltas[-1].finish_reason == "length" and len(st.completion.token_ids) == 8
        _idle(b)


KILLED_CLIENT = """
import sys
from client import Client, SamplingParams
c = Client(sys.argv[1], timeout=600)
params = SamplingParams(max_tokens=1000, ignore_eos=True)
streams = [c.stream([7] * 8, params, client=f"user-{i % 2}") for i in range(24)]
next(streams[0])  # generating
print("generating", flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_killed_or_stopped_client_has_its_requests_aborted_and_blocks_freed(server, sig):
    """SIGKILL: the client's connection drops; SIGSTOP: it stays up, but no heartbeat comes. Both are a silent
    client to the server (ZMQ does not say which connection dropped)."""
    with Client(server.address, timeout=HANG_S) as c:
        before = _idle(c)
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_CLIENT, server.address],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline().strip() == "generating"
            s = c.stats()
            assert s["pending"] > 0 and s["clients_pending"] >= 2  # two labels of one connection
            killed_at = time.monotonic()
            os.kill(proc.pid, sig)
            s = _idle(c)
            took = time.monotonic() - killed_at
        finally:
            proc.kill()
            proc.wait()
        # 24 requests of 1000 tokens one at a time run for minutes: these were aborted, not finished
        aborted = s["requests_aborted"] - before["requests_aborted"]
        assert aborted >= 12, s
        assert s["requests_aborted_client_silent"] - before["requests_aborted_client_silent"] == aborted
        assert took >= HEARTBEAT_TIMEOUT_S - 0.5  # a silent client is given its whole timeout
    assert "sent nothing for" in server.stderr()


def test_a_live_client_that_does_not_read_keeps_its_requests(server):
    with Client(server.address, timeout=HANG_S) as c, Client(server.address, timeout=HANG_S) as watcher:
        before = _idle(watcher)
        streams = [c.stream([7] * 8, LONG) for _ in range(PER_CLIENT)]
        time.sleep(2 * HEARTBEAT_TIMEOUT_S)  # not reading, far past the heartbeat timeout
        s = watcher.stats()
        assert s["requests_aborted_client_silent"] == before["requests_aborted_client_silent"], s
        assert s["pending"] > 0  # still running: the silence was real
        assert next(streams[0]).finish_reason != "abort"  # the first one runs first: it has deltas
        for st in streams:
            st.close()
        _idle(watcher)


def test_a_live_async_client_that_does_not_read_keeps_its_requests(server):
    async def main():
        async with AsyncClient(server.address, timeout=HANG_S) as c:
            streams = [c.stream([7] * 8, LONG) for _ in range(PER_CLIENT)]
            # the event loop runs, but no one reads the streams
            await asyncio.sleep(2 * HEARTBEAT_TIMEOUT_S)
            s = await c.stats()
            assert (await anext(streams[0])).finish_reason != "abort"
            for st in streams:
                await st.aclose()
            return s

    with Client(server.address, timeout=HANG_S) as watcher:
        before = _idle(watcher)
        s = asyncio.run(main())
        assert s["requests_aborted_client_silent"] == before["requests_aborted_client_silent"], s
        assert s["pending"] > 0
        _idle(watcher)


def test_request_table_counts_per_client_and_forgets_clients_with_nothing_pending():
    """What the limits read, kept per request in O(1): pending per (connection, label), silence per connection;
    a client with nothing pending leaves no entry behind (the coordinator must not grow with clients gone)."""
    from coordinator.request_table import RequestTable

    t = RequestTable()
    for i in range(3):
        t.add(b"a", f"r{i}", f"e{i}", "u1" if i else "")
    t.add(b"b", "r0", "e9")
    assert (t.pending_of(b"a"), t.pending_of(b"a", "u1"), t.pending_of(b"b"), t.clients) == (1, 2, 1, 3)
    t.seen(b"a", 100.0)
    t.seen(b"b", 50.0)
    t.seen(b"nobody", 1.0)  # a connection with nothing pending is not tracked
    ((identity, last_seen, reqs),) = t.silent_since(60.0)
    assert identity == b"b" and last_seen == 50.0 and [r.engine_id for r in reqs] == ["e9"]
    for engine_id in ("e0", "e1", "e2", "e9"):
        t.pop(engine_id)
    assert t.clients == 0 and not t._connections and not t._pending and len(t) == 0
    assert t.silent_since(1e9) == []
