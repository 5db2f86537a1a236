"""What does the HTTP front-end add to a streamed request's first token? Answered in docs/PERFORMANCE_LOG.md log 22h.
(CPU; no model, no GPU)

The coordinator's real ``Server`` loop runs in a thread over a stand-in engine that answers every request at once
(its first token on the next step, its end on the one after), and the real OpenAI front-end runs as a subprocess
in front of it, as ``launch.py --http-port`` starts it. Sequential streamed /v1/completions requests of 128 token
ids from a raw-socket client, then the same requests through the ZMQ ``AsyncClient`` straight to the coordinator:
the difference of their time to the first event is the front-end's (HTTP parsing, FastAPI, the hop to the
coordinator and back, the event's encoding). Prints p50 and mean of each, the last line JSON.

    python -m benchmarks.http_overhead [--requests 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

from coordinator.server import Server
from protocol.outputs import StepOutput

PROMPT = list(range(10, 138))
WARMUP = 20  # requests left out of the statistics


class InstantEngine:
    """The engine interface the coordinator's Server drives, answering every request in two steps."""

    def __init__(self) -> None:
        self.new: list[tuple[str, list[int]]] = []
        self.live: list[tuple[str, list[int]]] = []
        self.output_tokens = 0

    def admit(self, prompt, params) -> tuple[list[int], object]:
        return list(prompt), params

    def add_admitted(self, ids: list[int], params, engine_id: str, stream: bool = False) -> None:
        self.new.append((engine_id, ids))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.new or self.live)

    def step(self) -> list[StepOutput]:
        outs = [StepOutput(rid, [7], "x") for rid, _ in self.new]
        outs += [StepOutput(rid, [8], "y", finish_reason="length", prompt_token_ids=p) for rid, p in self.live]
        self.live, self.new = self.new, []
        self.output_tokens += len(outs)
        return outs

    def abort(self, request_id: str) -> None:
        return None

    def stats(self) -> dict:
        return dict(
            steps=0, preemptions=0, prefix_cache_hit_tokens=0, chunked_prefill_steps=0, kv_blocks_total=1,
            kv_blocks_free=1, running=len(self.live), waiting=0, prompt_tokens=0, output_tokens=self.output_tokens,
        )  # fmt: skip

    def info(self) -> dict:
        return dict(
            model="instant", max_model_len=4096, tensor_parallel_size=1, device="cpu", vocab_size=1000, block_size=16,
            kv_blocks_total=1, kv_capacity_tokens=16, max_num_seqs=256, worker_pids=[], coordinator_pid=os.getpid(),
            generation_defaults={},
        )  # fmt: skip

    def health(self) -> None:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_firsts(port: int, n: int) -> list[float]:
    """Seconds to the first event of ``n`` sequential streamed requests on one keep-alive connection."""
    body = json.dumps({"model": "instant", "prompt": PROMPT, "max_tokens": 2, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    request = (head + "\r\n\r\n").encode() + body
    firsts = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # a stuck server fails, not hangs
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            start, buf, first = time.perf_counter(), b"", None
            s.sendall(request)
            while not buf.endswith(b"0\r\n\r\n"):  # the chunked response's end
                buf += s.recv(65536)
                if first is None and b"data: {" in buf:
                    first = time.perf_counter() - start
            firsts.append(first)
            time.sleep(0.002)
    return firsts


async def zmq_firsts(address: str, n: int) -> list[float]:
    from client.async_client import AsyncClient
    from protocol.sampling_params import SamplingParams

    firsts = []
    async with AsyncClient(address) as client:
        for _ in range(n):
            start, first = time.perf_counter(), None
            async for _delta in client.stream(PROMPT, SamplingParams(max_tokens=2)):
                first = time.perf_counter() - start if first is None else first
            firsts.append(first)
            await asyncio.sleep(0.002)
    return firsts


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    # only stops a hang: on a busy host the front-end's imports alone can take a minute
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the front-end did not start listening")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--requests", type=int, default=300, help="sequential requests per client and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both clients, alternating")
    a = p.parse_args()
    server = Server("127.0.0.1", 0)
    local = server.listen_locally()  # the front-end's way in, as launch.py gives it
    loop = threading.Thread(target=server.serve, args=(InstantEngine(),), daemon=True)
    loop.start()
    address, port = f"tcp://127.0.0.1:{server.port}", _free_port()
    cmd = [sys.executable, "-m", "openai_server", "--address", local, "--port", str(port)]
    front = subprocess.Popen([*cmd, "--log-level", "warning"], stdout=subprocess.DEVNULL)
    try:
        _wait_listening(port, front)
        times: dict[str, list[float]] = {"http": [], "zmq": []}
        for _ in range(a.rounds):
            times["http"] += http_firsts(port, a.requests)[WARMUP:]
            times["zmq"] += asyncio.run(zmq_firsts(address, a.requests))[WARMUP:]
    finally:
        front.terminate()
        front.wait()
        server.stop()
        loop.join(10)
        server.close(0)  # the local socket's private dir too
    res = {f"{k}_p50_ms": round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    res |= {f"{k}_mean_ms": round(statistics.mean(v) * 1e3, 3) for k, v in times.items()}
    for k in times:
        print(f"{k:5s} first event p50 {res[k + '_p50_ms']:.3f} ms, mean {res[k + '_mean_ms']:.3f} ms")
    res["front_end_p50_ms"] = round(res["http_p50_ms"] - res["zmq_p50_ms"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
