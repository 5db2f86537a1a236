"""A fake model for driving coordinator/scheduler.py in tests.

The fake workers rebuild each slot's block table from the StepCommand deltas alone (as worker/model_runner.py
does), keep a "KV cache" holding the token id written at every cache slot (a whole step is written before any
of it is read, as each attention layer stores the step's K/V before attending), check that every sequence's
context reads back as its own tokens, replace -1 placeholders with the token they sampled last for that slot
(async scheduling) and sample random next tokens. ``check_invariants`` checks block ownership every step.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from coordinator.block_manager import BlockManager, block_key
from coordinator.scheduler import ScheduledBatch, Scheduler
from coordinator.sequence import SeqStatus, Sequence
from protocol.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(tokens: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(f"r{next(_ids)}", list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), 0.0)


def apply_slot_updates(tables: dict[int, list[int]], computed: dict[int, int], step) -> None:
    """A fake worker's bookkeeping of a StepCommand's slot changes: freed slots, new sequences, appended blocks."""
    for s in step.freed_slots.tolist():
        tables[s] = []
    for s, start in zip(step.new_slots.tolist(), step.new_start_pos.tolist()):
        tables[s], computed[s] = [], start
    ids = iter(step.new_block_ids.tolist())
    for s, c in zip(step.slots.tolist(), step.new_block_counts.tolist()):
        tables[s] += [next(ids) for _ in range(c)]


class FakeWorkers:
    def __init__(self, sched: Scheduler, seed: int = 0) -> None:
        bm = sched.block_manager
        self.bs = bm.block_size
        self.kv = np.full(bm.num_blocks * bm.block_size, -1, np.int64)  # token id held by each cache slot
        self.tables: dict[int, list[int]] = {}  # the workers' per-slot block tables
        self.computed: dict[int, int] = {}
        self.last: dict[int, int] = {}  # last sampled token per slot (fed where the step says -1)
        self.rng = np.random.default_rng(seed)

    def run(self, batch: ScheduledBatch) -> list[int]:
        step = batch.step
        apply_slot_updates(self.tables, self.computed, step)
        offset, written, reads = 0, set(), []
        num_prefills = len(step.prefill_num_tokens)
        assert all(n > 1 for n in step.prefill_num_tokens.tolist())
        num_tokens = step.prefill_num_tokens.tolist() + [1] * (len(step.slots) - num_prefills)
        assert num_tokens == batch.num_tokens
        for seq, s, n in zip(batch.seqs, step.slots.tolist(), num_tokens):
            assert seq.slot == s
            table, start = self.tables[s], self.computed[s]
            assert table == seq.block_table, f"{seq.request_id}: workers' table {table} != {seq.block_table}"
            assert start + n == seq.num_computed_tokens
            fed = step.token_ids[offset : offset + n].tolist()
            assert fed == seq.token_ids[start : start + n]
            assert all(t >= 0 for t in fed[:-1]), "only a sequence's last fed token may be a placeholder"
            fed = [self.last[s] if t < 0 else t for t in fed]
            offset += n
            cache_slots = [table[p // self.bs] * self.bs + p % self.bs for p in range(start + n)]
            new = cache_slots[start:]
            assert not written & set(new), f"{seq.request_id} writes a cache slot another sequence writes"
            written |= set(new)
            self.kv[new] = fed
            self.computed[s] = start + n
            reads.append((seq, cache_slots))
        assert offset == len(step.token_ids)
        # the context every token attends over is its sequence's own tokens (prefix hits included)
        for seq, cache_slots in reads:
            held = self.kv[cache_slots].tolist()
            want = seq.token_ids[: len(cache_slots)]
            assert all(w < 0 or h == w for h, w in zip(held, want)), f"{seq.request_id}: KV corrupted"
        skip = set(step.skip_sample_rows.tolist())
        assert [seq for r, seq in enumerate(batch.seqs) if r not in skip] == batch.sampled
        tokens = self.rng.integers(0, 1000, len(batch.sampled)).tolist()
        for seq, tok in zip(batch.sampled, tokens):
            self.last[seq.slot] = tok
        return tokens


def check_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    running, waiting = sched.running, list(sched.waiting)
    assert len(running) <= sched.max_num_seqs
    assert all(s.status is SeqStatus.RUNNING for s in running)
    assert all(s.status is SeqStatus.WAITING and s.block_table == [] and s.slot == -1 for s in waiting)
    slots = [s.slot for s in running]
    assert len(set(slots)) == len(slots) and all(0 <= x < sched.max_num_seqs for x in slots)
    assert sorted(slots + sched.free_slots) == list(range(sched.max_num_seqs))
    owners: dict[int, list[Sequence]] = {}
    for s in running:
        assert len(set(s.block_table)) == len(s.block_table)
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
        for b in s.block_table:
            owners.setdefault(b, []).append(s)
    for blk in bm.blocks:
        own = owners.get(blk.block_id, [])
        assert blk.ref_count == len(own), f"block {blk.block_id}: ref {blk.ref_count}, {len(own)} owners"
        assert (blk.block_id in bm.free) == (blk.ref_count == 0)
        if len(own) > 1:  # only a prefix-cache hit may be shared, and every owner holds exactly those tokens
            assert blk.key >= 0
            for s in own:
                i = s.block_table.index(blk.block_id)
                assert tuple(s.token_ids[i * bm.block_size : (i + 1) * bm.block_size]) == blk.token_ids
    for key, b in bm.cached.items():
        assert bm.blocks[b].key == key
        assert all(t >= 0 for t in bm.blocks[b].token_ids), "a placeholder token was keyed"
    for s in running:  # a keyed block's key is the chain hash of its owner's tokens up to it
        key = -1
        for i in range(s.num_keyed_blocks):
            key = block_key(s.token_ids[i * bm.block_size : (i + 1) * bm.block_size], key)
            blk = bm.blocks[s.block_table[i]]
            assert blk.key in (-1, key), f"{s.request_id}: block {blk.block_id} keyed with a wrong chain key"


def check_step(sched: Scheduler, batch: ScheduledBatch) -> None:
    n = batch.num_tokens
    assert sum(n) <= sched.max_num_batched_tokens
    assert 0 < len(batch.seqs) <= sched.max_num_seqs
    assert all(x > 0 for x in n)
    assert n == sorted(n, key=lambda x: x == 1)  # prefill chunks first, then single tokens
    assert len({id(s) for s in batch.seqs}) == len(batch.seqs)


class Driver:
    """Plays the engine's step loop (engine.Engine.step/_apply) around the scheduler and the fake workers;
    ``depth`` steps stay in flight ahead of the applied results (EngineConfig.async_depth)."""

    def __init__(
        self, sched: Scheduler, workers: FakeWorkers, stop_prob: float = 0.0, seed: int = 0, depth: int = 1
    ) -> None:
        self.sched, self.workers, self.depth = sched, workers, depth
        self.in_flight: deque[tuple[ScheduledBatch, list[int]]] = deque()
        self.stop_rng, self.stop_prob = np.random.default_rng(seed + 100), stop_prob

    @property
    def has_work(self) -> bool:
        return self.sched.has_work or bool(self.in_flight)

    def step(self) -> ScheduledBatch | None:
        batch = self.sched.schedule()
        # nothing scheduled and nothing in flight whose result could change that: stuck for good
        assert batch is not None or self.in_flight or not self.sched.has_work, "deadlock"
        if batch is not None:
            check_step(self.sched, batch)
            tokens = self.workers.run(batch)
        check_invariants(self.sched)
        if not self.sched.async_scheduling:
            if batch is not None:
                self.apply(batch, tokens)
            return batch
        if batch is not None:
            self.in_flight.append((batch, tokens))
        if self.in_flight and (len(self.in_flight) > self.depth or batch is None):
            self.apply(*self.in_flight.popleft())
        return batch

    def apply(self, batch: ScheduledBatch, tokens: list[int]) -> None:
        for seq, tok in zip(batch.sampled, tokens):
            if seq.status is SeqStatus.FINISHED:
                continue
            if seq.num_pending:
                seq.resolve_pending(tok)
            else:
                seq.token_ids.append(tok)
            done = seq.num_output_tokens - seq.num_pending
            if done >= seq.params.max_tokens:
                self.sched.finish(seq, "length")
            elif self.stop_rng.random() < self.stop_prob:
                self.sched.finish(seq, "stop")  # like an EOS
        check_invariants(self.sched)

    def run_to_end(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.has_work:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps


def new_scheduler(num_blocks: int, bs: int, max_seqs: int = 8, budget: int = 64, prefix: bool = True):
    sched = Scheduler(BlockManager(num_blocks, bs, prefix), max_seqs, budget)
    return sched, Driver(sched, FakeWorkers(sched))


def assert_all_released(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_work
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert sorted(bm.free) == list(range(bm.num_blocks))
    assert sorted(sched.free_slots) == list(range(sched.max_num_seqs))
