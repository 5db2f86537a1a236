"""What does the scheduler cost a decode step? (CPU; no model, no workers) Answered in docs/PERFORMANCE_LOG.md log 41f.

The coordinator's real ``Scheduler`` and ``BlockManager`` (prefix caching on) run W1-like sequences (prompts of
100-1,023 random ids) under async scheduling at depth 2, each step's tokens resolved two steps later as the engine
does. Once every prompt is in, it times ``schedule()`` over decode-only steps. Prints the time a step and a
sequence, the last line JSON.

    python -m benchmarks.schedule_step [--seqs 256] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque

import numpy as np

from coordinator.block_manager import BlockManager
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence
from protocol.sampling_params import SamplingParams


def run(num_seqs: int, steps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sched = Scheduler(BlockManager(num_seqs * 80, 16, True), num_seqs, 8192, async_scheduling=True)
    for i in range(num_seqs):
        prompt = rng.integers(0, 10000, int(rng.integers(100, 1024))).tolist()
        sched.add(Sequence(f"r{i}", prompt, len(prompt), SamplingParams(max_tokens=1 << 20), 0.0))
    in_flight: deque = deque()

    def step() -> int:
        batch = sched.schedule()
        in_flight.append(batch)
        if len(in_flight) > 2:  # the engine's async_depth 2: a step's tokens arrive two steps later
            for seq in in_flight.popleft().sampled:
                seq.resolve_pending(int(rng.integers(0, 10000)))
        return len(batch.seqs) if all(n == 1 for n in batch.num_tokens) else 0

    for _ in range(1000):  # until every prompt is in and each step decodes every sequence
        if step() == num_seqs:
            break
    else:
        raise RuntimeError(f"no decode step of all {num_seqs} sequences in 1,000 steps")
    start = time.perf_counter()
    for _ in range(steps):
        assert step() == num_seqs
    seconds = (time.perf_counter() - start) / steps
    return {"seqs": num_seqs, "steps": steps, "ms_per_step": seconds * 1e3, "us_per_seq": seconds * 1e6 / num_seqs}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seqs", type=int, default=256, help="running sequences (default 256, W1's batch)")
    p.add_argument("--steps", type=int, default=300, help="decode steps timed (default 300)")
    args = p.parse_args(argv)
    res = run(args.seqs, args.steps)
    print(f"schedule(): {res['ms_per_step']:.3f} ms a decode step of {res['seqs']} sequences "
          f"({res['us_per_seq']:.2f} us a sequence)")  # fmt: skip
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
