"""What benchmarks/serve.py (one run) and benchmarks/serve_sweep.py (``--sweep``) both send and count: the
streaming completion bodies, one timed request and its ``Result``, the server's model and vocabulary edge, and a
run's summary. Both import it, so neither needs the other (serve.py imports serve_sweep.py, never the reverse)."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.http_client import HttpClient

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
    sent: float = 0.0  # perf_counter when sent: with ttft and itl, when each chunk arrived


async def one_request(client: HttpClient, path: str, body: dict) -> Result:
    res = Result(prompt_tokens=len(body["prompt"]))
    t0 = res.sent = time.perf_counter()
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


def ms_stats(xs) -> dict:
    """Mean, p50 and p99 of seconds, in ms (zeros when empty)."""
    if not len(xs):
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    a = np.asarray(xs, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def outcome(results: list[Result], seconds: float) -> dict:
    """How many requests ran, completed and failed (the first error), and the completed ones a second."""
    ok = sum(r.ok for r in results)
    return {
        "num_requests": len(results),
        "completed": ok,
        "failed": len(results) - ok,
        "first_error": next((r.error for r in results if not r.ok), ""),
        "seconds": seconds,
        "request_throughput": ok / seconds,
    }


def summarize(results: list[Result], seconds: float, args, server_ttft: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "dataset": args.dataset,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        **outcome(results, seconds),
        "output_tokens": out,
        "output_tok_s": out / seconds,
        "total_tok_s": (out + prompt) / seconds,
        "ttft_ms": ms_stats([r.ttft for r in ok]),
        "tpot_ms": ms_stats([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_ms": ms_stats([x for r in ok for x in r.itl]),
        "server_ttft_mean_ms": None if server_ttft is None else server_ttft * 1e3,
    }
