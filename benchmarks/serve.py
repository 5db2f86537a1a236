"""HTTP load generator for any OpenAI-compatible server, in the manner of ``vllm bench serve --dataset-name random``.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000/v1 [--model NAME] [--dataset w1|random]
        [--num-prompts N] [--request-rate R|inf] [--max-concurrency N] [--random-input-len 1024]
        [--random-output-len 128] [--random-range-ratio 0.0] [--temperature 0.6] [--scale S]
        [--max-token-id N] [--api-key KEY] [--seed 0]
    python -m benchmarks.serve --sweep [--offline-tok-s T] [--loads 0.25 0.5 0.75 1] [--sweep-seconds S] [--out F]

Every request is a streaming completion (``stream: true``, ``ignore_eos: true``, ``stream_options.include_usage``)
whose prompt is a list of token ids, so no tokenizer is needed and any server that takes token-id prompts can be
measured. Arrivals are a Poisson process at ``--request-rate`` requests/s (``inf``: all at once).
  w1      benchmarks/throughput.py's W1 (256 prompts of 100-1024 random ids, 100-1024 output tokens, temperature
          0.6); ``--num-prompts`` keeps the first N, ``--scale`` divides the lengths (smoke runs).
  random  ``--random-input-len`` / ``--random-output-len`` tokens, each drawn from [len * (1 - ratio), len].
Ids above ``--max-token-id`` wrap around. Without it, the server is asked which ids its vocabulary holds (vLLM's
``/detokenize``, which nanoserve's server has too, refuses an id past it): a small model gets only ids it knows.

Reports request throughput, output tok/s, total tok/s, and TTFT, TPOT (per request: (latency - TTFT) / (output
tokens - 1)) and ITL (gaps between streamed events) mean/p50/p99 in ms; the LAST line is one JSON object. When the
server exposes vLLM's ``*:time_to_first_token_seconds`` histogram at ``/metrics`` (vLLM's and nanoserve's do), it
also reports the server's own mean TTFT over the run (``server_ttft_mean_ms``): what HTTP and this client add to a
first token is the difference. The client is benchmarks/http_client.py (asyncio streams, keep-alive): its own
cost counts in every TTFT, and it is the cheapest measured (benchmarks/client_overhead.py); each event is timed
when its line arrives, before it is parsed.

``--sweep``: the latency-under-load curve (benchmarks/serve_sweep.py): W1-shaped requests at fractions of a
capacity (``--offline-tok-s``, offline W1's output tok/s, else measured here at rate=inf), TTFT/ITL/TPOT p50 and p99
and goodput per load, one JSON (``--out``); benchmarks/plot_latency.py draws it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.http_client import HttpClient
from benchmarks.serve_sweep import add_sweep_args, main_sweep
from benchmarks.workloads import w1_requests

MAX_PROMPT_ID = 10000  # W1's ids are randint(0, 10000), and so are the random dataset's


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def build_requests(args) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request; ids in 0..MAX_PROMPT_ID (``run`` wraps them into the vocabulary)."""
    if args.dataset == "w1":
        reqs = [(r.prompt, r.max_tokens) for r in w1_requests(args.scale, args.num_prompts)]
    else:
        rng = random.Random(args.seed)
        lo_in = max(1, int(args.random_input_len * (1 - args.random_range_ratio)))
        lo_out = max(1, int(args.random_output_len * (1 - args.random_range_ratio)))
        reqs = [
            ([rng.randint(0, MAX_PROMPT_ID) for _ in range(rng.randint(lo_in, args.random_input_len))],
             rng.randint(lo_out, args.random_output_len))
            for _ in range(args.num_prompts or 256)
        ]  # fmt: skip
    return reqs


async def one_request(client: HttpClient, path: str, body: dict) -> Result:
    res = Result(prompt_tokens=len(body["prompt"]))
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.lines():  # one server-sent-events line at a time
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()  # before the parse: the client's own work is not the server's time
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - t0
        res.ok = last is not None
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


_TTFT_METRIC = "time_to_first_token_seconds"


async def server_ttft_totals(client: HttpClient) -> tuple[float, float] | None:
    """(sum of seconds, count) of the server's time-to-first-token histogram over all its label sets; None when
    the server has no such metric (parsed by hand: the load generator needs no Prometheus library)."""
    try:
        status, body = await client.request("GET", "/metrics")
        text = body.decode() if status == 200 else ""
    except Exception:  # no /metrics: the report just lacks the server's view
        return None
    totals, found = [0.0, 0.0], False
    for line in text.splitlines():
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        for i, suffix in enumerate(("_sum", "_count")):
            if name.endswith(_TTFT_METRIC + suffix):
                totals[i] += float((rest.rsplit("}", 1)[-1]).split()[0])
                found = True
    return (totals[0], totals[1]) if found else None


async def vocab_limit(client: HttpClient, model: str, want: int) -> int:
    """The largest id <= ``want`` the server's vocabulary holds: ``/detokenize`` refuses (4xx) an id past it, so a
    binary search finds the edge in ~14 requests. A server without the route (or that decodes any id) gets ``want``."""

    async def known(token: int) -> bool:
        status, _ = await client.request("POST", "/detokenize", {"model": model, "tokens": [token]})
        return status == 200

    if not await known(0) or await known(want):
        return want
    lo, hi = 0, want  # known(lo), not known(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if await known(mid) else (lo, mid)
    return lo


def split_base_url(base_url: str) -> tuple[str, str]:
    """(the server's root URL, the API's path): ``http://h:p/v1`` -> (``http://h:p``, ``/v1``)."""
    root = base_url.rstrip("/").rsplit("/v1", 1)[0]
    return root, base_url.rstrip("/")[len(root) :]


async def prepare(client: HttpClient, api: str, args) -> str:
    """The model name to send; ``args.max_token_id`` learnt from the server when not given."""
    model = args.model
    if model is None:
        status, body = await client.request("GET", api + "/models")
        if status != 200:
            sys.exit(f"GET {api}/models: HTTP {status}")
        model = json.loads(body)["data"][0]["id"]
    if args.max_token_id is None:
        args.max_token_id = await vocab_limit(client, model, MAX_PROMPT_ID)
        print(f"prompt ids    0..{args.max_token_id} (the server's vocabulary, by /detokenize)", flush=True)
    return model


def bodies_for(reqs: list[tuple[list[int], int]], model: str, args) -> list[dict]:
    return [
        {
            "model": model, "prompt": [t % (args.max_token_id + 1) for t in p], "max_tokens": n,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        for p, n in reqs
    ]  # fmt: skip


async def send_all(
    client: HttpClient, path: str, bodies: list[dict], rate: float, concurrency: int | None, seed: int
) -> tuple[list[Result], float]:
    """Every body at Poisson arrivals of ``rate`` requests/s (inf: at once), at most ``concurrency`` in flight;
    the results in order and the seconds from the first send to the last end."""
    gate = asyncio.Semaphore(concurrency or len(bodies) or 1)
    rng = np.random.default_rng(seed)

    async def gated(body: dict) -> Result:
        async with gate:
            return await one_request(client, path, body)

    tasks = []
    t0 = time.perf_counter()
    for body in bodies:
        tasks.append(asyncio.create_task(gated(body)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.exponential(1.0 / rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


async def run(args, reqs: list[tuple[list[int], int]]) -> tuple[list[Result], float, float | None]:
    root, api = split_base_url(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with HttpClient(root, headers) as client:
        model = await prepare(client, api, args)
        bodies = bodies_for(reqs, model, args)
        before = await server_ttft_totals(client)
        results, seconds = await send_all(
            client, api + "/completions", bodies, args.request_rate, args.max_concurrency, args.seed
        )
        after = await server_ttft_totals(client)
        server_ttft = None
        if before is not None and after is not None and after[1] > before[1]:
            server_ttft = (after[0] - before[0]) / (after[1] - before[1])
        return results, seconds, server_ttft


def _ms(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[Result], seconds: float, args, server_ttft: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "dataset": args.dataset,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), ""),
        "seconds": seconds,
        "request_throughput": len(ok) / seconds,
        "output_tokens": out,
        "output_tok_s": out / seconds,
        "total_tok_s": (out + prompt) / seconds,
        "ttft_ms": _ms([r.ttft for r in ok]),
        "tpot_ms": _ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_ms": _ms([x for r in ok for x in r.itl]),
        "server_ttft_mean_ms": None if server_ttft is None else server_ttft * 1e3,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL (…/v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--dataset", choices=["w1", "random"], default="w1", help="which requests to send (default w1)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests (w1: the first N of 256; random: 256)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most N requests in flight")
    p.add_argument("--random-input-len", type=int, default=1024, help="random: prompt length (upper bound)")
    p.add_argument("--random-output-len", type=int, default=128, help="random: output length (upper bound)")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="random: lengths from [len*(1-r), len]")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (W1's 0.6)")
    p.add_argument("--scale", type=int, default=1, help="w1: divide every length by S (smoke runs)")
    p.add_argument(
        "--max-token-id",
        type=int,
        default=None,
        help=f"prompt ids wrap above this (default: the server's vocabulary, at most {MAX_PROMPT_ID})",
    )
    p.add_argument("--seed", type=int, default=0, help="random dataset and arrival times")
    add_sweep_args(p)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.sweep:
        res = main_sweep(args)
        return {"failed": sum(s["failed"] for s in res["loads"])}
    reqs = build_requests(args)
    results, seconds, server_ttft = asyncio.run(run(args, reqs))
    s = summarize(results, seconds, args, server_ttft)
    print(f"requests      {s['completed']}/{s['num_requests']} ok in {s['seconds']:.2f} s, rate {s['request_rate']}")
    if s["failed"]:
        print(f"first error   {s['first_error']}")
    print(f"throughput    {s['request_throughput']:.2f} req/s, {s['output_tok_s']:,.1f} output tok/s, "
          f"{s['total_tok_s']:,.1f} total tok/s")  # fmt: skip
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        m = s[key]
        print(f"{key[:-3].upper():13s} mean {m['mean']:.2f} ms, p50 {m['p50']:.2f} ms, p99 {m['p99']:.2f} ms")
    if s["server_ttft_mean_ms"] is not None:
        print(f"TTFT (server) mean {s['server_ttft_mean_ms']:.2f} ms, by its /metrics")
    print(json.dumps(s), flush=True)
    return s


if __name__ == "__main__":
    sys.exit(0 if main()["failed"] == 0 else 1)
