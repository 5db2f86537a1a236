"""coordinator/scheduler.py driven by a fake model (tests/support/scheduler_driver.py): budgets, chunked prefill,
preemption, prefix sharing, and randomized runs (sync and async scheduling) that check ownership invariants and
the workers' view every step."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.block_manager import BlockManager, block_key
from coordinator.scheduler import Scheduler
from coordinator.sequence import SeqStatus
from tests.support.scheduler_driver import (
    Driver,
    FakeWorkers,
    assert_all_released,
    check_invariants,
    make_seq,
    new_scheduler,
)

# ---- focused cases -------------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decodes_going():
    sched, drv = new_scheduler(64, 16, budget=32)
    short = make_seq(list(range(5)), max_tokens=20)
    sched.add(short)
    drv.step()  # short's prefill
    long = make_seq(list(range(1000, 1100)), max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        batch = drv.step()
        by_seq = dict(zip(map(id, batch.seqs), batch.num_tokens))
        assert by_seq[id(short)] == 1  # the running decode is scheduled every step
        chunks.append(by_seq[id(long)])
        assert (long in batch.sampled) == (long.num_computed_tokens == 100)
    assert chunks == [31, 31, 31, 7]
    assert sched.stats.chunked_prefill_steps == 3
    drv.run_to_end()
    assert_all_released(sched)


def test_budget_limits_admission_and_max_num_seqs():
    sched, drv = new_scheduler(64, 4, max_seqs=3, budget=10)
    seqs = [make_seq([i] * 4, max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch = drv.step()
    assert batch.num_tokens == [4, 4, 2]  # the third is chunked to fit the 10-token budget
    assert len(sched.running) == 3 and len(sched.waiting) == 2
    drv.run_to_end()
    assert all(s.num_output_tokens == 3 for s in seqs)
    assert_all_released(sched)


@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_when_the_pool_runs_out_restarts_from_zero(prefix):
    sched, drv = new_scheduler(4, 4, budget=64, prefix=prefix)
    a = make_seq([1, 2, 3, 4, 5, 6], max_tokens=6)
    b = make_seq([7, 8, 9, 10, 11, 12], max_tokens=6)
    sched.add(a)
    sched.add(b)
    drv.step()  # both prefilled: 2 blocks each, pool full
    assert sched.block_manager.num_free_blocks == 0
    drv.step()  # positions 6 and 7 still fit in the second block
    drv.step()
    assert sched.stats.preemptions == 0
    b_slot = b.slot
    batch = drv.step()  # a's position 8 needs a third block: b (newest) is preempted
    assert sched.stats.preemptions == 1
    assert batch.seqs == [a]
    assert b.status is SeqStatus.WAITING and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.slot == -1
    assert b.num_output_tokens == 3  # its generated tokens are kept and recomputed
    assert b_slot in batch.step.freed_slots.tolist()  # the workers hear about it in this very step
    while b.status is SeqStatus.WAITING:
        batch = drv.step()
        if b.status is SeqStatus.WAITING:
            assert b not in batch.seqs
    row = batch.seqs.index(b)
    start = batch.step.new_start_pos[batch.step.new_slots.tolist().index(b.slot)]
    if prefix:  # its own first block, keyed before the preemption, is revived
        assert start == b.num_cached_tokens == 4
    else:
        assert start == 0 and batch.num_tokens[row] == b.num_prompt_tokens + 3  # the whole sequence again
    assert b in batch.sampled
    drv.run_to_end()
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert_all_released(sched)


def test_finished_slots_are_told_to_workers_and_reused():
    sched, drv = new_scheduler(16, 4, max_seqs=2)
    a, b, c = (make_seq([i] * 6, max_tokens=mt) for i, mt in ((1, 1), (2, 5), (3, 2)))
    for s in (a, b, c):
        sched.add(s)
    drv.step()  # a and b admitted; a finishes at once
    assert a.is_finished and a.slot == -1 and c.status is SeqStatus.WAITING
    batch = drv.step()  # c takes the freed slot; the workers reset it first
    freed, new = batch.step.freed_slots.tolist(), batch.step.new_slots.tolist()
    assert new == [c.slot] and freed == [c.slot] and c.slot != b.slot
    drv.run_to_end()
    assert_all_released(sched)


def test_two_requests_with_one_prefix_in_one_step():
    """Prefix blocks are keyed when scheduled, so the second request shares the first's prefix in the same
    step (each layer stores the step's K/V before attending); every unshared block is its own."""
    sched, drv = new_scheduler(32, 4)
    prefix = list(range(100, 112))
    x, y = make_seq(prefix + [1, 2], max_tokens=4), make_seq(prefix + [3, 4, 5], max_tokens=4)
    sched.add(x)
    sched.add(y)
    batch = drv.step()  # the fake workers' KV check fails if y reads anything but the prefix
    assert set(batch.seqs) == {x, y}
    assert y.num_cached_tokens == 12 and y.block_table[:3] == x.block_table[:3]
    assert not set(x.block_table[3:]) & set(y.block_table[3:])
    assert all(sched.block_manager.blocks[b].ref_count == 2 for b in x.block_table[:3])
    assert batch.num_tokens == [14, 3]
    drv.run_to_end()
    assert_all_released(sched)


def test_last_chunk_of_a_prompt_is_shared_in_the_step_that_computes_it():
    sched, drv = new_scheduler(32, 4, budget=14)
    prompt = list(range(200, 220))
    x = make_seq(prompt, max_tokens=2)
    sched.add(x)
    drv.step()  # x computes 14 tokens: 3 full blocks keyed
    y = make_seq(prompt + [1], max_tokens=2)
    sched.add(y)
    batch = drv.step()  # x computes its last 6; y reads all 20 of them, 8 written in this very step
    assert batch.seqs == [x, y] and batch.num_tokens == [6, 1]
    assert y.num_cached_tokens == 20 and y.block_table[:5] == x.block_table[:5]
    drv.run_to_end()
    assert_all_released(sched)


def test_fully_cached_prompt_still_computes_its_last_token():
    sched, drv = new_scheduler(32, 4)
    for n, expect_cached in [(12, 8), (13, 12)]:
        prompt = list(range(500, 500 + n))
        sched.add(make_seq(prompt, max_tokens=1))
        drv.run_to_end()
        again = make_seq(prompt, max_tokens=1)
        sched.add(again)
        batch = drv.step()
        assert again.num_cached_tokens == expect_cached
        assert batch.num_tokens == [n - expect_cached] and batch.sampled == [again]
        assert again.is_finished
    assert_all_released(sched)


def test_forged_cache_entry_is_not_used():
    sched, drv = new_scheduler(16, 4)
    other = make_seq([9, 9, 9, 9, 9, 9], max_tokens=1)
    sched.add(other)
    drv.run_to_end()
    victim = sched.block_manager.cached[block_key([9, 9, 9, 9], -1)]
    prompt = [1, 2, 3, 4, 5, 6]
    forged = block_key(prompt[:4], -1)
    sched.block_manager.cached[forged] = victim  # a hash collision
    seq = make_seq(prompt, max_tokens=2)
    sched.add(seq)
    batch = sched.schedule()
    drv.workers.run(batch)  # its KV check fails if the forged block is read as seq's prefix
    assert seq.num_cached_tokens == 0 and victim not in seq.block_table
    assert sched.block_manager.cached[forged] == victim  # left alone, not overwritten by seq's block
    del sched.block_manager.cached[forged]
    check_invariants(sched)


def test_finish_while_waiting_and_abort_release_everything():
    sched, drv = new_scheduler(8, 4, max_seqs=2)
    seqs = [make_seq([i] * 5, max_tokens=5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    drv.step()
    sched.finish(seqs[0], "abort")  # running
    sched.finish(seqs[3], "abort")  # waiting
    check_invariants(sched)
    assert seqs[3] not in sched.waiting and seqs[3].finish_reason == "abort"
    drv.run_to_end()
    assert_all_released(sched)


def test_async_placeholders_resolve_in_order():
    sched = Scheduler(BlockManager(16, 4), 4, 64, async_scheduling=True)
    drv = Driver(sched, FakeWorkers(sched))
    s = make_seq([1, 2, 3], max_tokens=3)
    sched.add(s)
    b0 = drv.step()  # prefill, sampled: one placeholder
    assert s.token_ids[-1] == -1 and s.num_pending == 1 and s.output_token_ids == []
    b1 = drv.step()  # decodes the placeholder; step 0's token arrives
    assert b1.step.token_ids.tolist() == [-1]
    assert s.num_pending == 1 and len(s.output_token_ids) == 1 and s.output_token_ids[0] >= 0
    drv.run_to_end()
    assert s.is_finished and s.num_pending == 0 and len(s.output_token_ids) == 3
    assert all(t >= 0 for t in s.token_ids)
    assert b0.step.step_id == 0
    assert_all_released(sched)


# ---- randomized runs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling,depth", [(False, 1), (True, 1), (True, 2)], ids=["sync", "async", "async2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_run_completes_everything_without_leaks(seed, async_scheduling, depth):
    rng = np.random.default_rng(seed)
    bs, num_blocks, max_seqs, budget = 4, 24, 6, 16
    sched = Scheduler(BlockManager(num_blocks, bs), max_seqs, budget, async_scheduling=async_scheduling)
    drv = Driver(sched, FakeWorkers(sched, seed), stop_prob=0.01, seed=seed, depth=depth)
    prefixes = [rng.integers(0, 1000, int(rng.integers(4, 30))).tolist() for _ in range(5)]
    pending = []
    for _ in range(200):
        max_tokens = int(rng.integers(1, 30))
        if rng.random() < 0.5:
            p = prefixes[int(rng.integers(0, 5))]
            prompt = p[: int(rng.integers(1, len(p) + 1))] + rng.integers(0, 1000, int(rng.integers(0, 10))).tolist()
        else:
            prompt = rng.integers(0, 1000, int(rng.integers(1, 60))).tolist()
        prompt = prompt[: num_blocks * bs - max_tokens]  # the engine refuses what can never fit
        pending.append(make_seq(prompt, max_tokens=max_tokens))
    all_seqs = list(pending)
    steps = 0
    while pending or drv.has_work:
        for _ in range(int(rng.integers(0, 3))):  # arrivals while the engine runs
            if pending:
                sched.add(pending.pop(0))
        if not drv.has_work:
            continue
        drv.step()  # asserts no deadlock
        steps += 1
        assert steps < 5000, "no progress"
        if rng.random() < 0.02 and sched.running:  # the odd abort
            sched.finish(sched.running[int(rng.integers(0, len(sched.running)))], "abort")
            check_invariants(sched)
    for s in all_seqs:
        assert s.is_finished and s.num_pending == 0 and all(t >= 0 for t in s.token_ids)
        if s.finish_reason == "length":
            assert s.num_output_tokens == s.params.max_tokens
        else:
            assert s.num_output_tokens <= s.params.max_tokens
    assert sum(s.finish_reason == "length" for s in all_seqs) > 100
    assert_all_released(sched)
    st = sched.stats
    assert st.preemptions > 0 and st.prefix_cache_hit_tokens > 0 and st.chunked_prefill_steps > 0
