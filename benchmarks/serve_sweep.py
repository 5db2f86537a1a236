"""``python -m benchmarks.serve --sweep``: the latency-under-load curve of a running server.

W1-shaped requests (benchmarks/workloads.py: 100-1024 prompt ids, 100-1024 output tokens, temperature 0.6,
ignore_eos) arrive as a Poisson process at fractions (``--loads``, default 25/50/75/100%) of a capacity: offline
W1's output tok/s (``--offline-tok-s``, turned into requests/s by the requests' mean output length), else the
server's own, measured first at rate=inf over the same requests. Each load sends ``rate x --sweep-seconds``
requests (at least ``--sweep-min-requests``, at most ``--sweep-max-requests``), each prompt shifted so that no
load hits the prefix cache of another. Per load: TTFT, ITL (gaps between streamed events) and TPOT mean/p50/p99,
throughput, and goodput.

Goodput (vLLM's ``bench serve --goodput`` definition): the requests that meet every SLO, per second, and their output
tokens per second. The SLOs default to TTFT <= 1000 ms and TPOT <= 100 ms (``--slo-ttft-ms``, ``--slo-tpot-ms``;
TPOT = (latency - TTFT) / (output tokens - 1), per request), i.e. ``vllm bench serve --goodput ttft:1000 tpot:100``:
a chat user sees the first words within a second and reads faster than ten tokens a second arrive.

The last line printed is the JSON (also written to ``--out``); benchmarks/plot_latency.py draws it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import time

import numpy as np

from benchmarks.http_client import HttpClient
from benchmarks.serve_requests import (
    Result,
    bodies_for,
    ms_stats,
    one_request,
    outcome,
    prepare,
    split_base_url,
    summarize,
)
from benchmarks.workloads import fresh, w1_requests

DEFAULT_LOADS = (0.25, 0.5, 0.75, 1.0)
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 100.0
W1_SIZE = 256


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep (--sweep)")
    g.add_argument("--sweep", action="store_true", help="the latency-under-load curve instead of one run")
    g.add_argument("--offline-tok-s", type=float, default=None, help="offline W1 output tok/s: 100%% load (default: "
                   "measured here at rate=inf)")  # fmt: skip
    g.add_argument("--loads", type=float, nargs="+", default=list(DEFAULT_LOADS), help="fractions of the capacity")
    g.add_argument("--sweep-seconds", type=float, default=30.0, help="arrivals per load: rate x this many seconds")
    g.add_argument("--sweep-min-requests", type=int, default=20, help="at least this many requests a load")
    g.add_argument("--sweep-max-requests", type=int, default=512, help="at most this many requests a load")
    g.add_argument("--drain-seconds", type=float, default=300.0, help="after a load's last arrival, requests still "
                   "running this long are cancelled (counted as failed)")  # fmt: skip
    g.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS, help="goodput: TTFT at most this")
    g.add_argument("--slo-tpot-ms", type=float, default=SLO_TPOT_MS, help="goodput: TPOT at most this")
    g.add_argument("--label", default=None, help="what ran (e.g. 'H200, Qwen3-8B bf16'), for the plot's title")
    g.add_argument("--out", default=None, help="write the sweep's JSON here too")


def load_requests(args, load_index: int, n: int) -> list[tuple[list[int], int]]:
    """``n`` W1 requests (cycling through its 256), each prompt shifted by the load and the cycle: the prefix cache
    of one load (or cycle) never serves another."""
    base = w1_requests(args.scale)
    out = []
    for i in range(n):
        r = base[i % W1_SIZE]
        out.append((fresh(r.prompt, 1 + 64 * load_index + i // W1_SIZE), r.max_tokens))
    return out


def steady_tok_s(results, start: float, end: float) -> float:
    """Streamed chunks (a token each) that arrived between ``start`` and ``end`` (perf_counter), per second: the
    output rate while requests keep arriving, without the ramp up or the drain after the last arrival."""
    times = [np.cumsum([r.sent + r.ttft, *r.itl]) for r in results if r.ok]
    stamps = np.concatenate(times) if times else np.zeros(0)
    return float(((stamps >= start) & (stamps < end)).sum() / max(end - start, 1e-9))


def load_summary(results, seconds: float, load: float, rate: float, args, window=None) -> dict:
    """One load's figures (times in ms); ``results`` are benchmarks/serve_requests.py's ``Result``s; ``window``: the
    (start, end) of the steady part of the arrivals, for ``steady_output_tok_s``."""
    ok = [r for r in results if r.ok]
    tpots = {id(r): (r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1}
    good = [
        r for r in ok
        if r.ttft * 1e3 <= args.slo_ttft_ms and tpots.get(id(r), 0.0) * 1e3 <= args.slo_tpot_ms
    ]  # fmt: skip
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    s = {
        "load": load,
        "rate_req_s": rate,
        **outcome(results, seconds),
        "output_tok_s": out_tokens / seconds,
        "steady_output_tok_s": steady_tok_s(results, *window) if window else None,
        "ttft_ms": ms_stats([r.ttft for r in ok]),
        "itl_ms": ms_stats(itl),
        "tpot_ms": ms_stats(list(tpots.values())),
        "good_requests": len(good),
        "goodput_req_s": len(good) / seconds,
        "goodput_tok_s": sum(r.output_tokens for r in good) / seconds,
    }
    s["itl_p99_over_p50"] = s["itl_ms"]["p99"] / s["itl_ms"]["p50"] if s["itl_ms"]["p50"] else None
    return s


async def _send_load(client, path: str, bodies: list[dict], rate: float, args, seed: int):
    """benchmarks/serve.py's ``send_all``, bounded in time: requests still running ``--drain-seconds`` after the last
    arrival are cancelled (their connections close, so the server aborts them) and count as failed."""
    rng = np.random.default_rng(seed)
    tasks = []
    t0 = time.perf_counter()
    for body in bodies:
        tasks.append(asyncio.create_task(one_request(client, path, body)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.exponential(1.0 / rate))
    arrivals_end = time.perf_counter()
    done, pending = await asyncio.wait(tasks, timeout=args.drain_seconds)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    seconds = time.perf_counter() - t0
    cut = f"still running {args.drain_seconds:g} s after the last arrival: cancelled"
    # the steady part: after the first third of the arrivals (the ramp up while the first requests start)
    window = (t0 + (arrivals_end - t0) / 3, arrivals_end)
    return [t.result() if t in done else Result(error=cut) for t in tasks], seconds, window


async def run_sweep(args) -> dict:
    root, api = split_base_url(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    mean_out = float(np.mean([r.max_tokens for r in w1_requests(args.scale)]))
    async with HttpClient(root, headers) as client:
        model = await prepare(client, api, args)
        path = api + "/completions"
        if args.offline_tok_s is not None:
            capacity = {"tok_s": args.offline_tok_s, "source": "--offline-tok-s (offline W1)"}
        else:  # the server's own ceiling, over the same kind of requests
            bodies = bodies_for(load_requests(args, len(args.loads), W1_SIZE), model, args)
            results, seconds, _ = await _send_load(client, path, bodies, math.inf, args, args.seed)
            args.request_rate = math.inf
            full = summarize(results, seconds, args)
            capacity = {"tok_s": full["output_tok_s"], "source": "measured: W1 over HTTP at rate=inf"}
        capacity["req_s"] = capacity["tok_s"] / mean_out
        loads = []
        for k, load in enumerate(args.loads):
            rate = load * capacity["req_s"]
            n = int(min(args.sweep_max_requests, max(args.sweep_min_requests, math.ceil(rate * args.sweep_seconds))))
            bodies = bodies_for(load_requests(args, k, n), model, args)
            results, seconds, window = await _send_load(client, path, bodies, rate, args, args.seed + k)
            loads.append(load_summary(results, seconds, load, rate, args, window))
            print_load(loads[-1])
    return {
        "kind": "latency_sweep",
        "label": args.label or f"{platform.node()}",
        "model": model,
        "workload": "W1" + (f" / {args.scale}" if args.scale > 1 else ""),
        "mean_output_tokens": mean_out,
        "capacity": capacity,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "as": "vllm bench serve --goodput"},
        "loads": loads,
    }


def print_load(s: dict) -> None:
    t, i, p = s["ttft_ms"], s["itl_ms"], s["tpot_ms"]
    print(
        f"load {100 * s['load']:5.1f}%  {s['rate_req_s']:7.2f} req/s  ok {s['completed']:4d}/{s['num_requests']:<4d} "
        f"TTFT p50 {t['p50']:9.2f} p99 {t['p99']:9.2f}  ITL p50 {i['p50']:8.2f} p99 {i['p99']:8.2f}  "
        f"TPOT p50 {p['p50']:8.2f}  out {s['output_tok_s']:9.1f} tok/s (while arriving "
        f"{s.get('steady_output_tok_s') or 0:9.1f})  goodput {s['goodput_tok_s']:9.1f} tok/s",
        flush=True,
    )


def main_sweep(args) -> dict:
    res = asyncio.run(run_sweep(args))
    c = res["capacity"]
    print(f"capacity      {c['tok_s']:,.1f} output tok/s = {c['req_s']:.3f} req/s ({c['source']})")
    print(f"SLO           TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms (goodput)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res), flush=True)
    return res
