"""Soak and fault run against a nanoserve server: mixed HTTP and ZMQ traffic for ``--minutes``, then a look at what
it left behind.

    python -m benchmarks.soak --minutes 10 [--faults] [--concurrency 8] [--seed 0]
        [--base-url http://127.0.0.1:8000/v1 --address tcp://127.0.0.1:8765 [--api-key KEY]]
        [--tracemalloc DIR] [-- extra launch.py flags]

Without ``--base-url``/``--address`` it starts ``python launch.py --port 0 --http-port 0`` (the embedded tiny model on
the CPU unless extra flags say otherwise) and stops it at the end. Traffic: completions and chat over HTTP (streamed
and not, stop strings, logprobs, token-id prompts), /tokenize, streams the client closes after a few chunks, client
read timeouts; ZMQ generate/stream/chat/tokenize from a client replaced every 20 requests (new identities), streams
left early, waits that give up, requests refused by field. ``--faults`` adds oversized bodies, malformed JSON,
wrong types, integers past 2^64 and, every 20 s, a ZMQ client process killed with its requests in flight.

It prints requests, outcomes by kind (``UNEXPECTED ...`` for what a healthy server must never do), p50/p99 latency
of completed requests, and for the coordinator and the HTTP front-end their RSS (VmRSS) and open fds, plus the free
KV blocks, at the start, every ``--sample-s`` seconds, and at the end (after waiting for the server to go idle).
The LAST line is one JSON object. ``--tracemalloc DIR`` (only when it starts the server) runs the coordinator under
benchmarks/soak_trace.py, which writes tracemalloc snapshots to DIR; ``--trim-every S`` there calls malloc_trim.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.pipe_lines import PipeLines
from benchmarks.soak_trace import add_trim_flag
from benchmarks.soak_traffic import Traffic, killed_client
from client import AsyncClient

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "512",
                "--max-num-seqs", "32", "--max-num-batched-tokens", "1024"]  # fmt: skip
# (weight, action name): HTTP and ZMQ, well-formed; faults are added with --faults
MIX = [
    (6, "http_completion"), (6, "http_completion_stream"), (5, "http_chat"), (5, "http_chat_stream"),
    (2, "http_tokenize"), (2, "http_disconnect"), (1, "http_timeout"),
    (5, "zmq_generate"), (5, "zmq_stream"), (3, "zmq_chat"), (2, "zmq_tokenize"), (2, "zmq_leave"),
    (1, "zmq_timeout"), (1, "zmq_bad"),
]  # fmt: skip


def proc_status(pid: int | None) -> dict:
    """VmRSS (MiB) and open fds of ``pid`` from /proc (None when it is gone or unknown)."""
    if pid is None:
        return {"rss_mib": None, "fds": None}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, AttributeError):
        return {"rss_mib": None, "fds": None}
    return {"rss_mib": round(rss, 1), "fds": fds}


def front_end_pid(coordinator_pid: int) -> int | None:
    """The HTTP front-end: the coordinator's child running openai_server (a local server only)."""
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != coordinator_pid:
                continue
            if b"openai_server" in (d / "cmdline").read_bytes():
                return int(d.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


class Launched:
    """``launch.py --port 0 --http-port 0``: its ZMQ address and HTTP base URL from its two ready lines."""

    def __init__(self, extra: list[str], log_path: Path, args, timeout: float = 300) -> None:
        runner = [str(ROOT / "launch.py")]
        if args.tracemalloc or args.trim_every:  # the same launch.py, under benchmarks/soak_trace.py
            trace = ["--every", str(args.sample_s), "--trim-every", str(args.trim_every)]
            trace += [] if args.tracemalloc else ["--no-trace"]
            runner = ["-m", "benchmarks.soak_trace", *trace, str(Path(args.tracemalloc or log_path.parent).resolve())]
            runner.append("--")  # options before DIR: argparse takes no option after the positionals have started
        cmd = [sys.executable, *runner, "--port", "0", "--http-port", "0", *extra]
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)  # fmt: skip
        self.address = self.base_url = None
        deadline, reader = time.monotonic() + timeout, PipeLines(self.proc.stdout)
        while self.address is None or self.base_url is None:
            for line in reader.poll(1.0):
                if line.startswith("nanoserve listening on "):
                    self.address = line.split()[-1]
                elif line.startswith("nanoserve OpenAI API on "):
                    self.base_url = line.split()[4]
            if (reader.ended or time.monotonic() > deadline) and (self.address is None or self.base_url is None):
                why = "exited" if reader.ended else f"did not start in {timeout:g} s"
                reader.close()
                self.stop()
                raise RuntimeError(f"the server {why}; its log: {log_path}")
        reader.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.wait()


async def snapshot(address: str, api_key: str | None, pids: dict) -> dict:
    async with AsyncClient(address, token=api_key, timeout=60, connect_timeout=30) as c:
        s = await c.stats()
    out = {"t": round(time.monotonic(), 1), "kv_blocks_free": s["kv_blocks_free"], "pending": s["pending"]}
    for name, pid in pids.items():
        st = proc_status(pid)
        out[f"{name}_rss_mib"], out[f"{name}_fds"] = st["rss_mib"], st["fds"]
    return out


async def wait_idle(address: str, api_key: str | None, timeout: float = 120) -> None:
    """Until the server holds no request (aborts of vanished clients included), or ``timeout``."""
    deadline = time.monotonic() + timeout
    async with AsyncClient(address, token=api_key, timeout=60, connect_timeout=30) as c:
        while time.monotonic() < deadline:
            s = await c.stats()
            if s["pending"] == 0 and s["running"] == 0 and s["waiting"] == 0:
                return
            await asyncio.sleep(0.5)


async def drive(args, traffic: Traffic, address: str, pids: dict) -> dict:
    mix = MIX + ([(4, "http_fault")] if args.faults else [])
    names, weights = [n for _, n in mix], [w for w, _ in mix]
    kinds: collections.Counter = collections.Counter()
    per_action: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    latencies: list[float] = []
    samples = [await snapshot(address, args.api_key, pids)]
    end = time.monotonic() + args.minutes * 60

    async def act(name: str, slot: int) -> tuple[str, float]:
        if name.startswith("http_"):
            what = name.removeprefix("http_")
            if what in ("completion", "completion_stream", "chat", "chat_stream"):
                return await traffic.http_generate(what.startswith("chat"), what.endswith("stream"))
            return await getattr(traffic, name)()
        return await traffic.zmq_generate(name.removeprefix("zmq_"), slot)

    async def worker(slot: int) -> None:
        while time.monotonic() < end:
            name = traffic.rng.choices(names, weights)[0]
            kind, latency = await act(name, slot)
            kinds[kind] += 1
            per_action[name][kind] += 1
            if kind == "ok" and name not in ("http_tokenize", "zmq_tokenize"):
                latencies.append(latency)

    async def killer() -> None:
        while time.monotonic() < end - 5:
            await asyncio.sleep(20)
            kind, _ = await killed_client(address, args.api_key)
            kinds[kind] += 1
            per_action["killed_client"][kind] += 1

    async def sampler() -> None:
        while time.monotonic() < end:
            await asyncio.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
            samples.append(await snapshot(address, args.api_key, pids))

    tasks = [asyncio.ensure_future(worker(i)) for i in range(args.concurrency)] + [asyncio.ensure_future(sampler())]
    if args.faults:
        tasks.append(asyncio.ensure_future(killer()))
    await asyncio.gather(*tasks)
    samples.append(await snapshot(address, args.api_key, pids))  # right after the traffic
    await wait_idle(address, args.api_key)
    samples.append(await snapshot(address, args.api_key, pids))  # idle again
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    return {
        "requests": sum(kinds.values()),
        "kinds": dict(kinds.most_common()),
        "per_action": {k: dict(v) for k, v in sorted(per_action.items())},
        "unexpected": sum(n for k, n in kinds.items() if k.startswith("UNEXPECTED")),
        "latency_p50_ms": round(float(np.percentile(lat, 50)), 1),
        "latency_p99_ms": round(float(np.percentile(lat, 99)), 1),
        "samples": samples,
    }


async def run(args, base_url: str, address: str) -> dict:
    async with AsyncClient(address, token=args.api_key, timeout=60, connect_timeout=60) as c:
        info = await c.info()
    pids = {"coordinator": info["coordinator_pid"], "front_end": front_end_pid(info["coordinator_pid"])}
    if not Path(f"/proc/{pids['coordinator']}").exists():
        pids = {"coordinator": None, "front_end": None}  # a server on another host: no /proc figures
    traffic = Traffic(base_url, address, Path(info["model"]).name, info["vocab_size"], args.api_key, args.seed)
    traffic.model = await _served_model(traffic)
    try:
        result = await drive(args, traffic, address, pids)
    finally:
        await traffic.aclose()
    result["kv_blocks_total"] = info["kv_blocks_total"]
    return result


async def _served_model(traffic: Traffic) -> str:
    resp = await traffic.http.get(traffic.base_url + "/models", headers=traffic.headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def report(res: dict, minutes: float) -> dict:
    start, busy, end = res["samples"][0], res["samples"][-2], res["samples"][-1]
    print(f"soak: {res['requests']} requests in {minutes:g} min, {res['unexpected']} unexpected")
    for kind, n in res["kinds"].items():
        print(f"  {n:7d}  {kind}")
    print(f"latency of completed requests: p50 {res['latency_p50_ms']} ms, p99 {res['latency_p99_ms']} ms")
    print(f"{'':>10} {'coord MiB':>10} {'coord fds':>10} {'front MiB':>10} {'front fds':>10} {'KV free':>8}")
    for label, s in [("start", start), ("busy end", busy), ("idle end", end)] + [
        (f"t+{s['t'] - start['t']:.0f}s", s) for s in res["samples"][1:-2]
    ]:
        row = [s["coordinator_rss_mib"], s["coordinator_fds"], s["front_end_rss_mib"], s["front_end_fds"]]
        print(f"{label:>10} " + " ".join(f"{'-' if v is None else v:>10}" for v in row) + f" {s['kv_blocks_free']:>8}")
    summary = {
        "minutes": minutes,
        "requests": res["requests"],
        "unexpected": res["unexpected"],
        "errors": {k: n for k, n in res["kinds"].items() if k != "ok"},
        "latency_p50_ms": res["latency_p50_ms"],
        "latency_p99_ms": res["latency_p99_ms"],
        "kv_blocks_total": res["kv_blocks_total"],
        "start": start,
        "end": end,
        "samples": res["samples"],
        "per_action": res["per_action"],
    }
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs (default 10)")
    p.add_argument("--faults", action="store_true", help="add oversized/malformed requests and killed clients")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between RSS/fd/KV samples (default 30)")
    p.add_argument("--base-url", help="an HTTP server's /v1 URL (with --address: attach, start nothing)")
    p.add_argument("--address", help="the same server's ZMQ address, e.g. tcp://127.0.0.1:8765")
    p.add_argument("--api-key", default=None, help="the server's API key (given to a started server too)")
    p.add_argument("--seed", type=int, default=0, help="the traffic's random seed (default 0)")
    p.add_argument("--log", default="soak_server.log", help="the started server's stderr (default soak_server.log)")
    p.add_argument("--tracemalloc", metavar="DIR", help="snapshot the started coordinator's heap into DIR")
    add_trim_flag(p)
    p.add_argument("launch_flags", nargs="*", help="after --: launch.py flags (default: a small CPU engine)")
    args = p.parse_args(argv)
    if bool(args.base_url) != bool(args.address):
        p.error("--base-url and --address go together (attach to a running server), or neither (start one)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the finally: the server is stopped
    if not args.base_url:
        flags = args.launch_flags + (["--api-key", args.api_key] if args.api_key else [])
        server = Launched(flags if args.launch_flags else ENGINE_FLAGS + flags, Path(args.log), args)
        args.base_url, args.address = server.base_url, server.address
        print(f"started {args.address} and {args.base_url} (log: {args.log})", flush=True)
    try:
        res = asyncio.run(run(args, args.base_url, args.address))
    finally:
        code = server.stop() if server is not None else None
    summary = report(res, args.minutes)
    if server is not None:
        summary["server_exit_code"] = code
    print(json.dumps(summary), flush=True)
    return 0 if res["unexpected"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
