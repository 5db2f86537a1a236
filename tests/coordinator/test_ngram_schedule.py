"""n-gram speculation through the real scheduler (coordinator/spec_schedule.py, scheduler.py) and the real result
application (coordinator/step_apply.py), against fake workers that verify drafts the way the contract says: a
deterministic "model" (the next token a function of the last two, so sequences fall into loops and drafts get
accepted), a KV cache written through the block tables the step commands build, greedy acceptance. Every run is
compared token for token with the same run without speculation, in sync and async scheduling, with tight pools
(preemption), shared prefixes (prefix hits) and small budgets (chunked prefill)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from coordinator.block_manager import BlockManager
from coordinator.output_processor import OutputProcessor
from coordinator.scheduler import ScheduledBatch, Scheduler
from coordinator.sequence import Sequence
from coordinator.spec_schedule import MAX_BACKOFF, Speculator
from coordinator.speculative import SpeculativeConfig
from coordinator.step_apply import ResultApplier
from protocol.messages import StepResult
from protocol.sampling_params import SamplingParams
from tests.support.scheduler_driver import apply_slot_updates, check_invariants

MAX_MODEL_LEN = 4096


def model(context: list[int], vocab: int) -> int:
    return (context[-1] * 7 + (context[-2] if len(context) > 1 else 0) * 3 + 1) % vocab


class VerifyingWorkers:
    """Rebuilds block tables and a token-id KV cache from the step commands alone; verify rows as the contract says."""

    def __init__(self, sched: Scheduler, vocab: int, model=model) -> None:
        self.bs, self.vocab, self.model = sched.block_manager.block_size, vocab, model
        self.kv = np.full(sched.block_manager.num_blocks * self.bs, -1, np.int64)
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.verify_rows = 0

    def run(self, batch: ScheduledBatch) -> StepResult:
        step = batch.step
        apply_slot_updates(self.tables, self.computed, step)
        prefills = step.prefill_num_tokens.tolist()
        drafts = [] if step.draft_counts is None else step.draft_counts.tolist()
        assert step.draft_counts is None or (len(drafts) == len(prefills) and any(drafts))
        num_tokens = prefills + [1] * (len(step.slots) - len(prefills))
        skip = set(step.skip_sample_rows.tolist())
        out, accepted, offset = [], [], 0
        for row, (seq, s, n) in enumerate(zip(batch.seqs, step.slots.tolist(), num_tokens)):
            d = drafts[row] if row < len(drafts) else 0
            fed = step.token_ids[offset : offset + n].tolist()
            offset += n
            assert all(t >= 0 for t in fed[:-1]) and (d == 0 or fed[-1] >= 0), "a placeholder inside a row"
            fed = [self.last[s] if t < 0 else t for t in fed]
            start, table = self.computed[s], self.tables[s]
            assert len(table) * self.bs >= start + n, "no block for a verify position"
            slots = [table[p // self.bs] * self.bs + p % self.bs for p in range(start + n)]
            self.kv[slots[start:]] = fed
            context = self.kv[slots].tolist()
            known = [t for t in seq.token_ids[: start + 1 + (n - 1 if d == 0 else 0)]]
            assert all(k < 0 or k == c for k, c in zip(known, context)), f"{seq.request_id}: KV corrupted"
            if row in skip:
                self.computed[s] = start + n
                continue
            emitted: list[int] = []
            base = context[: start + n - d]
            for j in range(d + 1):  # greedy: accept while the draft is the model's own token
                emitted.append(self.model(base + emitted, self.vocab))
                if j == d or emitted[-1] != fed[n - d + j]:
                    break
            self.verify_rows += d > 0
            self.computed[s] = start + n - d + len(emitted) - 1
            self.last[s] = emitted[-1]
            out += emitted
            accepted.append(len(emitted) - 1)
        num_accepted = None if step.draft_counts is None else np.array(accepted, np.int32)
        return StepResult(step.step_id, 0, np.array(out, np.int32), num_accepted=num_accepted)


def run(
    prompts,
    max_tokens,
    spec,
    *,
    async_depth=0,
    blocks=256,
    bs=4,
    budget=64,
    vocab=7,
    prefix=True,
    off_above=8,
    fake=model,
):
    """Every prompt to its end; returns ({request: output tokens}, the engine's stand-in)."""
    cfg = SpeculativeConfig("ngram", 3, 1, 3, disable_by_batch_size=off_above) if spec else None
    sched = Scheduler(
        BlockManager(blocks, bs, prefix),
        8,
        budget,
        async_scheduling=async_depth > 0,
        speculator=Speculator(cfg, MAX_MODEL_LEN) if cfg else None,
    )
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    engine = SimpleNamespace(
        scheduler=sched,
        output_processor=OutputProcessor(tokenizer),
        eos_token_ids=set(),
        requests={},
        num_constrained=0,
        num_prompt_tokens_computed=0,
        num_output_tokens=0,
    )
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        seq = Sequence(f"r{i}", list(p), len(p), SamplingParams(temperature=0, max_tokens=m), 0.0)
        seq.every_token = engine.output_processor.add(seq, False)
        sched.add(seq)
    workers = VerifyingWorkers(sched, vocab, fake)
    in_flight: deque = deque()
    done = {}
    for _ in range(20_000):
        if not (sched.has_work or in_flight):
            break
        batch = sched.schedule()
        assert batch is not None or in_flight, "deadlock"
        if batch is not None:
            in_flight.append((batch, workers.run(batch)))
        check_invariants(sched)
        if in_flight and (len(in_flight) > async_depth or batch is None):
            for out in ResultApplier.apply_result(engine, *in_flight.popleft()):
                assert out.finish_reason == "length"
                done[out.request_id] = out.token_ids
            check_invariants(sched)
    assert not sched.has_work and not in_flight
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks)
    return done, engine, workers


def _cases(seed: int, count: int, shared: bool):
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 7, 9).tolist()
    prompts = [(head if shared else []) + rng.integers(0, 7, int(rng.integers(2, 12))).tolist() for _ in range(count)]
    return prompts, rng.integers(5, 60, count).tolist()


@pytest.mark.parametrize("async_depth", [0, 1, 2])
@pytest.mark.parametrize(
    "engine_kw",
    [{}, {"blocks": 24}, {"budget": 7}, {"bs": 16, "blocks": 10, "budget": 9}],
    ids=["roomy", "preempting", "chunked", "tight"],
)
def test_speculation_changes_no_token(async_depth, engine_kw):
    prompts, max_tokens = _cases(async_depth * 10 + len(engine_kw), 6, shared=True)
    want, _, _ = run(prompts, max_tokens, False, async_depth=async_depth, **engine_kw)
    got, engine, workers = run(prompts, max_tokens, True, async_depth=async_depth, **engine_kw)
    assert got == want
    assert {r: len(t) for r, t in got.items()} == {f"r{i}": m for i, m in enumerate(max_tokens)}
    stats = engine.scheduler.speculator.stats
    assert stats.num_drafts == workers.verify_rows > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both acceptance and rejection happened
    assert engine.num_output_tokens >= sum(max_tokens)


def test_no_drafts_above_disable_by_batch_size():
    prompts, _ = _cases(5, 5, shared=False)
    got, engine, workers = run(prompts, [40] * 5, True, async_depth=1, off_above=4)
    want, _, _ = run(prompts, [40] * 5, False, async_depth=1)
    assert got == want
    # five running sequences, one over: no drafts until one finishes (they all finish together: none at all)
    assert workers.verify_rows == engine.scheduler.speculator.stats.num_drafts == 0
    _, engine, _ = run(prompts, [40] * 5, True, async_depth=1, off_above=5)
    assert engine.scheduler.speculator.stats.num_drafts > 0


def test_failing_drafts_back_off():
    """At acceptance ~0 (the next token a random function of the position: n-grams recur, their continuations are
    wrong) a sequence leaves the async overlap (held for its in-flight tokens, or in a verify row) a few dozen times in
    2000 tokens, not every step: each costly failure doubles its wait, up to MAX_BACKOFF steps."""
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 20, 4096).tolist()
    held = []
    plan = Speculator.plan

    def counting(self, running, step_id):
        drafts, h = plan(self, running, step_id)
        held.append(len(h))
        return drafts, h

    Speculator.plan = counting
    try:
        got, engine, workers = run(
            [[1, 2, 3]], [2000], True, async_depth=2, vocab=20, blocks=600, fake=lambda c, v: noise[len(c)]
        )
    finally:
        Speculator.plan = plan
    assert got == {"r0": noise[3:2003]}
    stats = engine.scheduler.speculator.stats
    tries = 2000 / MAX_BACKOFF + 10  # at the cap, after the doublings up to it
    assert stats.num_accepted_tokens < stats.num_draft_tokens / 5
    assert 0 < workers.verify_rows < tries
    assert sum(held) < 2 * 2 * tries  # a try holds the sequence for its in-flight steps (async depth 2) at most
