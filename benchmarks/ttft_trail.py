"""Where does a first token's time go between a client and the engine? The same kind of request (128 fresh random
ids, greedy), one at a time ``--gap`` seconds apart, by every path:

  offline       nanoserve.LLM in this process, max_tokens=1 (W2's TTFT probe)
  zmq           client.AsyncClient straight to the coordinator, streamed, max_tokens=1 (and 16: ``zmq16``)
  http          a raw-socket client to ``launch.py --http-port``, streamed (``http``, ``http16``) and not
                (``http_full``, whose TTFT is the whole response of a 1-token request)

against one coordinator and front-end run with time stamps (benchmarks/trail_hooks.py), so that each streamed
request also gets its trail: client send, front-end receive, coordinator receive, tokenized, step sent, result
read, first Delta sent, front-end's Delta, the SSE bytes, client receive. Prints each path's TTFT p50/mean, each
hop's p50 and two sums per request (their p50): the front-end's own time (client send to Generate sent, first Delta
read to client receive) and the coordinator hop's both ways (ZMQ; from the HTTP front-end, its Unix socket); and for
HTTP the front-end's CPU time per request (p50), idle wake-ups included (compare runs of like TTFTs). The last line
is JSON. benchmarks/frontend_cpu.py times the front-end's Python alone, in-process, for A/B on a loaded box.

    python -m benchmarks.ttft_trail [--model DIR] [--requests 100] [--gap 0.1] [--paths offline zmq http ...]
                                    [-- engine flags for both the offline LLM and launch.py]
    # the device, Qwen3-8B shape at ~1 req/s (~170 s):
    python -m benchmarks.ttft_trail --model DIR --requests 30 --rounds 3 --gap 1 --paths offline zmq http \
        -- --load-format dummy --max-model-len 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks.trail_read import OWN_SPANS, cpu_per_request, hops, read_trail, span_p50, trail_of

PATHS = ("offline", "zmq", "zmq16", "http", "http16", "http_full")
MAX_ID = 8000  # inside the embedded model's vocabulary (8192) and any real one


def _prompts(n: int, seed: int, max_id: int = MAX_ID) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(10, max_id) for _ in range(128)] for _ in range(n)]


def offline_ttfts(model: str, extra: list[str], prompts: list[list[int]], gap: float) -> list[float]:
    """W2's probe, one prompt at a time: the engine takes the server's engine flags (``extra``) too."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.serve_args import engine_kwargs, parse_args

    out = []
    with LLM(**engine_kwargs(parse_args([*(["--model", model] if model else []), *extra]))) as llm:
        for p in prompts:
            t0 = time.perf_counter()
            llm.generate([p], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            out.append(time.perf_counter() - t0)
            time.sleep(gap)
    return out


async def zmq_ttfts(address: str, prompts: list[list[int]], gap: float, tokens: int) -> list[tuple[str, float, float]]:
    """(request id, send time, first delta time) per request."""
    from client.async_client import AsyncClient
    from protocol.sampling_params import SamplingParams

    out = []
    async with AsyncClient(address) as client:
        for p in prompts:
            t0 = time.perf_counter()
            stream = client.stream(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
            first = None
            async for _ in stream:
                first = first or time.perf_counter()
            out.append((stream.request_id, t0, first))
            await asyncio.sleep(gap)
    return out


def served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
        return json.load(r)["data"][0]["id"]


def http_ttfts(port: int, prompts: list[list[int]], gap: float, tokens: int, stream: bool, tag: str):
    """(trail id, send time, first event time) per request, on one keep-alive connection."""
    out, model = [], served_model(port)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, p in enumerate(prompts):
            body = json.dumps({"model": model, "prompt": p, "max_tokens": tokens, "temperature": 0, "stream": stream,
                               "ignore_eos": True}).encode()  # fmt: skip
            tid = f"{tag}{i}"
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-trail-id: {tid}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            buf, first = b"", None
            t0 = time.perf_counter()
            s.sendall(head.encode() + body)
            while True:
                data = s.recv(65536)
                if not data:
                    raise ConnectionError(f"the server closed the connection: {buf[:300]!r}")
                buf += data
                if stream and first is None and b"data: {" in buf:
                    first = time.perf_counter()
                if (stream and buf.endswith(b"0\r\n\r\n")) or (not stream and _complete(buf)):
                    break
            if not buf.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"request failed: {buf[:300]!r}")
            out.append((tid, t0, first or time.perf_counter()))
            time.sleep(gap)
    return out


def _complete(buf: bytes) -> bool:
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def start_server(model: str, extra: list[str], trail: str) -> tuple[subprocess.Popen, str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "benchmarks.trail_hooks", "coordinator", trail, "--", "--port", "0",
           "--http-port", str(http_port), "--log-level", "warning", *(["--model", model] if model else []),
           *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    address = None
    for line in proc.stdout:  # the listening line, then the front-end's
        if line.startswith("nanoserve listening on "):
            address = line.split()[-1]
        if line.startswith("nanoserve OpenAI API on"):
            return proc, address, http_port
    raise RuntimeError(f"the server exited with code {proc.wait()} before it served")


def _stats(xs: list[float]) -> dict:
    return {"p50_ms": round(statistics.median(xs) * 1e3, 3), "mean_ms": round(statistics.mean(xs) * 1e3, 3)}


def run_paths(a, extra: list[str]) -> tuple[dict[str, list], str]:
    """Each path's (key, send, first) list, the requests of all paths interleaved in rounds; the trail file."""
    n, rounds = a.requests, max(1, a.rounds)
    seeds = {path: 1000 * (i + 1) for i, path in enumerate(PATHS)}
    got: dict[str, list] = {path: [] for path in a.paths}
    if "offline" in a.paths:  # before the server starts: nothing else of ours runs meanwhile
        prompts = _prompts(n + a.warmup, seeds["offline"], a.max_id)
        ttfts = offline_ttfts(a.model, extra, prompts, a.gap)[a.warmup :]
        got["offline"] = [("-", 0.0, t) for t in ttfts]
    trail = tempfile.mktemp(prefix="ttft_trail_", suffix=".txt")
    proc, address, port = start_server(a.model, extra, trail)
    try:
        per = -(-n // rounds)
        for r in range(rounds + 1):  # round 0: the warm-up, left out
            for path in (p for p in a.paths if p != "offline"):
                prompts = _prompts(a.warmup if r == 0 else per, seeds[path] + r, a.max_id)
                tokens = 16 if path.endswith("16") else 1
                if path.startswith("zmq"):
                    res = asyncio.run(zmq_ttfts(address, prompts, a.gap, tokens))
                else:
                    res = http_ttfts(port, prompts, a.gap, tokens, path != "http_full", f"{path}.{r}.")
                if r:
                    got[path] += res
    finally:
        proc.send_signal(signal.SIGTERM)  # drains; the trail files are written as the processes exit
        proc.wait(120)
    return got, trail


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="", help="a model directory (default: the embedded model)")
    p.add_argument("--requests", type=int, default=100, help="timed requests per path")
    p.add_argument("--rounds", type=int, default=4, help="the paths take turns this many times")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests per path first")
    p.add_argument("--gap", type=float, default=0.1, help="seconds between a reply and the next request")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, help="the ways to the engine timed")
    p.add_argument("--max-id", type=int, default=MAX_ID, help="prompt ids up to this (within the vocabulary)")
    a, extra = p.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    got, trail = run_paths(a, extra)
    keyed, loose = read_trail(trail)
    res: dict = {"requests": a.requests, "gap_s": a.gap}
    for path, rows in got.items():
        res[path] = _stats([first - t0 for _, t0, first in rows])
    for path in ("zmq", "http", "http16", "zmq16"):
        if got.get(path):
            trails = [trail_of(keyed, loose, key, t0, first) for key, t0, first in got[path]]
            res[path]["hops_p50_ms"] = hops(trails)
            for name, spans in OWN_SPANS.get(path.removesuffix("16"), {}).items():
                res[path][f"{name}_p50_ms"] = span_p50(trails, spans)
    for path in ("http", "http16", "http_full"):
        if got.get(path):
            res[path]["front_end_cpu_p50_ms"] = cpu_per_request(keyed, [key for key, _, _ in got[path]])
    for path in got:
        cpu = res[path].get("front_end_cpu_p50_ms")
        cpu = f", front-end CPU {cpu} ms a request (p50)" if cpu is not None else ""
        print(f"{path:10s} TTFT p50 {res[path]['p50_ms']:8.3f} ms, mean {res[path]['mean_ms']:8.3f} ms{cpu}")
    for path in ("zmq", "http"):
        if "hops_p50_ms" in res.get(path, {}):
            print(f"{path} hops (p50, ms):")
            for hop, ms in res[path]["hops_p50_ms"].items():
                print(f"  {hop:24s} {ms:8.3f}")
            for name in OWN_SPANS[path]:
                print(f"  {name + ' (sum, p50)':24s} {res[path][f'{name}_p50_ms']}")
    for name in (trail, trail + ".front"):
        if os.path.exists(name):
            os.unlink(name)
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
