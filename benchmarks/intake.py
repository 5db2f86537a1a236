"""Coordinator host time when W1's 256 requests arrive at once: from ``LLM.generate`` to the first step command
sent, and the garbage collector's pauses inside it, with the start-up objects collected and frozen (the engine's
default) and without (as before docs/PERF.md log 9g). Runs on the CPU with the embedded model; no worker step is taken.

    python benchmarks/intake.py
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.llm import LLM  # noqa: E402
from protocol.sampling_params import SamplingParams  # noqa: E402


class _FirstStep(Exception):
    pass


def time_intake(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float]:
    """(ms from generate() to the first send_step, ms of GC pauses in between); leaves no request behind."""
    engine, sent, pauses = llm.engine, [], []

    def send(step) -> None:
        sent.append(time.perf_counter())
        raise _FirstStep

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            on_gc.t0 = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - on_gc.t0)

    real_send = engine.workers.send_step
    engine.workers.send_step = send
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except _FirstStep:
        pass  # generate() aborts its requests on the way out
    finally:
        gc.callbacks.remove(on_gc)
        engine.workers.send_step = real_send
    engine.scheduler.running.clear()  # the scheduled but never sent step
    return (sent[0] - t0) * 1e3, sum(pauses) * 1e3


def main() -> None:
    rows = []
    for label in ("unfrozen", "frozen (default)"):
        real = gc.collect, gc.freeze
        if label == "unfrozen":
            gc.collect = gc.freeze = lambda *_: 0  # the engine's start-up collection and freeze, skipped
        try:
            llm = LLM(device="cpu", max_model_len=4096, num_kv_blocks=20_000)
        finally:
            gc.collect, gc.freeze = real
        vocab = llm.engine.vocab_size
        rng = random.Random(0)  # W1's lengths (../shared/REFERENCE.md), ids folded into the embedded model's vocab
        prompts = [[rng.randint(0, 10_000) % vocab for _ in range(rng.randint(100, 1024))] for _ in range(256)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024)) for _ in prompts]
        tracked = len(gc.get_objects())
        intake, pauses = time_intake(llm, prompts, params)
        rows.append((label, tracked, intake, pauses))
        llm.engine.shutdown()
    print(f"{'start-up objects':>18s} {'tracked':>9s} {'intake ms':>10s} {'GC pause ms':>12s}")
    for label, tracked, intake, pauses in rows:
        print(f"{label:>18s} {tracked:9d} {intake:10.1f} {pauses:12.1f}")


if __name__ == "__main__":
    main()
