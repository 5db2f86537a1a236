"""What does a verify step cost? (one worker in this process, no coordinator) Speculative decoding's cost curve: the
time of a step whose rows each score k drafts (1 + k tokens) against a plain decode step, at each batch size, and the
speedup that predicts as a function of the acceptance rate.

    python -m benchmarks.spec_cost --shape qwen3-8b [--batch 1 8 64] [--k 5] [--context 512]
    torchrun --nproc-per-node 2 -m benchmarks.spec_cost --shape qwen3-8b --batch 1      # TP=2 (rank 0 prints)

A verify step is timed as the engine runs it: launched, then waited on (the next step's drafts and positions need
its accepted counts). The plain decode step is timed both ways: waited on, and pipelined (async scheduling, the
engine's steady state without speculation), the baseline of the prediction. With each draft accepted with
probability a, a verify step emits (1 - a^(k+1)) / (1 - a) tokens, so the predicted speedup is that count times
pipelined decode / verify. The drafts are random ids (nearly none accepted); each row keeps its context length
(the accepted length is rewound), so every step of a phase sees the same contexts. Last line: JSON."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from benchmarks.profile_step import decode_step, make_runner, pipelined_decode, prefill_prompts, step

STEPS = 50
RATES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0)


def verify_step(step_id: int, slots: list[int], k: int, rng: np.random.Generator):
    """Each of ``slots`` scores k random drafts after its last sampled token (fed back: -1)."""
    tokens = np.concatenate([np.r_[-1, rng.integers(10, 1000, k)] for _ in slots]).tolist()
    cmd = step(step_id, slots, [1 + k] * len(slots), tokens, [[] for _ in slots])
    cmd.draft_counts = np.full(len(slots), k, np.int32)
    return cmd


def timed(run, n: int = STEPS) -> float:
    """Mean seconds per step of ``run(i)`` over n steps, after 5 unmeasured ones."""
    for i in range(5):
        run(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        run(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def expected_tokens(k: int, a: float) -> float:
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def main() -> None:
    from benchmarks.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES), help="model shape (random weights)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="batch sizes")
    p.add_argument("--k", type=int, default=5, help="draft counts 1..K")
    p.add_argument("--context", type=int, default=512, help="tokens each sequence holds before the timed steps")
    a = p.parse_args()
    max_bs = max(a.batch)
    blocks_per_seq = (a.context + a.k + 64) // 16 + 1
    runner = make_runner(a.shape, 256, max_bs * blocks_per_seq, None, "auto", False)  # the engine's max_num_seqs
    rng = np.random.default_rng(0)
    slots_all = list(range(max_bs))
    blocks = [[s * blocks_per_seq + j for j in range(blocks_per_seq)] for s in slots_all]
    prefill_prompts(runner, slots_all, a.context, blocks)
    rows, sid = [], 1
    for bs in a.batch:
        slots = slots_all[:bs]

        def rewind(slots=slots):
            torch.cuda.synchronize()
            if runner.unsettled is not None:  # the last verify step's accepted counts
                runner.settle()
            runner.num_computed[slots] = a.context

        def plain(i, slots=slots, sid=sid):
            runner.num_computed[slots] = a.context
            runner.execute(decode_step(sid + i, slots))

        decode_s = timed(plain)
        rewind()
        t0 = time.perf_counter()
        pipelined_decode(runner, slots, STEPS, sid)
        pipelined_s = (time.perf_counter() - t0) / STEPS
        row = {"batch": bs, "decode_ms": 1e3 * decode_s, "pipelined_ms": 1e3 * pipelined_s, "verify_ms": {}}
        for k in range(1, a.k + 1):
            rewind()

            def verify(i, slots=slots, k=k, sid=sid):
                if runner.unsettled is not None:  # as the next step's launch would, before the positions are reset
                    runner.settle()
                runner.num_computed[slots] = a.context
                runner.execute(verify_step(sid + i, slots, k, rng))

            row["verify_ms"][k] = 1e3 * timed(verify)
        rows.append(row)
        sid += 1000
    print(f"\n{a.shape}, context {a.context}: ms a step (verify: launched and waited on, as the engine runs it)")
    print(f"{'batch':>5} {'decode':>7} {'piped':>7} " + " ".join(f"{'k=' + str(k):>7}" for k in range(1, a.k + 1)))
    for r in rows:
        ks = " ".join(f"{r['verify_ms'][k]:7.3f}" for k in range(1, a.k + 1))
        print(f"{r['batch']:5d} {r['decode_ms']:7.3f} {r['pipelined_ms']:7.3f} {ks}")
    print("\npredicted speedup over pipelined decode, by acceptance rate a (per draft), best k in brackets")
    print(f"{'batch':>5} " + " ".join(f"{'a=' + str(x):>10}" for x in RATES))
    for r in rows:
        cells = []
        for x in RATES:
            gain = {k: expected_tokens(k, x) * r["pipelined_ms"] / v for k, v in r["verify_ms"].items()}
            best = max(gain, key=gain.get)
            cells.append(f"{gain[best]:6.2f} ({best})")
        print(f"{r['batch']:5d} " + " ".join(f"{c:>10}" for c in cells))
    print(json.dumps({"shape": a.shape, "context": a.context, "rows": rows}))


if __name__ == "__main__":
    main()
