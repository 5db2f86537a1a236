"""The request lists of the workloads (benchmarks/WORKLOADS.md), drawn as nano-vllm's bench.py draws them; every
length divided by ``scale`` for smoke runs (the same random draws). benchmarks/throughput.py says how each is run
and timed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int
    cached: int = 0  # prompt ids a perfect prefix cache would already hold (floor only)


def _cut(n: int, scale: int) -> int:
    return max(1, n // scale)


def w1_requests(scale: int = 1, num_prompts: int | None = None) -> list[Request]:
    """nano-vllm bench.py's draws, in its order: all prompts first, then all max_tokens."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    reqs = [Request(p[: _cut(len(p), scale)], _cut(m, scale)) for p, m in zip(prompts, max_tokens)]
    return reqs[:num_prompts] if num_prompts else reqs


def w2_prompts(scale: int = 1, count: int = 4) -> tuple[list[list[int]], int]:
    """``count`` fresh 128-id prompts (3 for TTFT, 1 for the full run) and the output length (512)."""
    rng = random.Random(0)
    return [[rng.randint(0, 10000) for _ in range(_cut(128, scale))] for _ in range(count)], _cut(512, scale)


def w3_requests(scale: int = 1, num_prompts: int | None = None, prefix_cached: bool = True) -> list[Request]:
    rng = random.Random(0)
    plen = _cut(2048, scale)
    prefix = [rng.randint(0, 10000) for _ in range(plen)]
    reqs = [
        Request(prefix + [rng.randint(0, 10000) for _ in range(_cut(64, scale))], _cut(128, scale))
        for _ in range(num_prompts or 256)
    ]
    if prefix_cached:
        for r in reqs[1:]:
            r.cached = plen
    return reqs


def fresh(prompt: list[int], shift: int = 1) -> list[int]:
    """The same prompt shifted by ``shift`` ids: same lengths and distribution, no prefix-cache hit on the original
    or on another shift."""
    return [(t + shift) % 10001 for t in prompt]


def warmup_prompt() -> list[int]:
    return [random.Random(1).randint(0, 10000) for _ in range(8)]
