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

import numpy as np

from benchmarks.http_client import HttpClient
from benchmarks.serve_requests import MAX_PROMPT_ID, Result, bodies_for, one_request, prepare, split_base_url, summarize
from benchmarks.serve_sweep import add_sweep_args, main_sweep
from benchmarks.workloads import w1_requests


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
