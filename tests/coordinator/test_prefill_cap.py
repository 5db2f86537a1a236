"""The scheduler's prefill cap beside decodes (EngineConfig.max_prefill_beside_decodes): a prompt that arrives while
others decode is spread over steps of a few hundred tokens, so no stream waits a whole prompt's prefill for its next
token; a backlog larger than a step's budget, or no decode running, takes the whole budget as before."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.block_manager import BlockManager
from coordinator.scheduler import Scheduler
from nanoserve.serve_args import engine_kwargs, parse_args
from settings.defaults import SERVER_PREFILL_BESIDE_DECODES
from tests.support.scheduler_driver import Driver, FakeWorkers, assert_all_released, check_invariants, make_seq


def _capped(cap: int, budget: int = 512, max_seqs: int = 8, async_scheduling: bool = False):
    sched = Scheduler(
        BlockManager(512, 4), max_seqs, budget, async_scheduling=async_scheduling, max_prefill_beside_decodes=cap
    )
    return sched, Driver(sched, FakeWorkers(sched))


def _chunks_of(drv: Driver, seq, step_sizes: list[int] | None = None) -> list[int]:
    chunks = []
    while seq.num_output_tokens == 0:
        batch = drv.step()
        by_seq = dict(zip(map(id, batch.seqs), batch.num_tokens))
        chunks.append(by_seq.get(id(seq), 0))
        if step_sizes is not None:
            step_sizes.append(sum(batch.num_tokens))
    return chunks


def test_a_prompt_beside_decodes_is_spread_over_capped_steps():
    sched, drv = _capped(cap=32)
    streams = [make_seq([i, i + 1], max_tokens=100) for i in range(3)]
    for s in streams:
        sched.add(s)
    drv.step()  # their prefill: no decode runs yet, so the whole budget
    prompt = make_seq(list(range(1000, 1300)), max_tokens=2)
    sched.add(prompt)
    # 300 tokens waiting: a quarter (75), then a quarter of what is left while that is more than the cap less the
    # 3 decode rows (29): from there each step carries 32 tokens in all, the size the cap names
    sizes: list[int] = []
    assert _chunks_of(drv, prompt, sizes) == [75, 56, 42, 31, 29, 29, 29, 9]
    assert sizes == [78, 59, 45, 34, 32, 32, 32, 12]
    drv.run_to_end()
    assert_all_released(sched)


def test_many_decode_rows_leave_a_prompt_half_the_cap():
    sched, drv = _capped(cap=32, budget=512, max_seqs=32)
    for i in range(24):
        sched.add(make_seq([i, i + 1], max_tokens=100))
    drv.step()
    prompt = make_seq(list(range(1000, 1100)), max_tokens=2)
    sched.add(prompt)
    assert _chunks_of(drv, prompt)[:3] == [25, 18, 16]  # a quarter of 100, of 75, then half of 32: not 32 - 24
    drv.run_to_end()
    assert_all_released(sched)


def test_the_drafts_decode_rows_verify_count_in_the_step():
    sched, drv = _capped(cap=32)
    for i in range(3):
        sched.add(make_seq([i, i + 1], max_tokens=100))
    drv.step()
    sched.add(make_seq(list(range(1000, 1040)), max_tokens=2))  # a quarter of 40 is under the cap
    assert sched._prefill_cap(0) == 29  # 32 less 3 decode rows
    assert sched._prefill_cap(8) == 21  # ... less 8 draft tokens they verify
    assert sched._prefill_cap(30) == 16  # never under half the cap


@pytest.mark.parametrize("decoding", [False, True])
def test_the_whole_budget_without_decodes_or_for_a_backlog_over_one_step(decoding):
    sched, drv = _capped(cap=32, budget=128)
    if decoding:
        sched.add(make_seq([1, 2], max_tokens=50))
        drv.step()
    burst = [make_seq(list(range(100 * i, 100 * i + 60)), max_tokens=2) for i in range(1, 4)]  # 180 > 128
    for s in burst:
        sched.add(s)
    batch = drv.step()
    assert sum(n for s, n in zip(batch.seqs, batch.num_tokens) if s in burst) == 128 - decoding


def test_without_a_cap_a_prompt_beside_decodes_takes_the_budget():
    sched, drv = _capped(cap=0)
    sched.add(make_seq([1, 2], max_tokens=50))
    drv.step()
    prompt = make_seq(list(range(1000, 1300)), max_tokens=2)
    sched.add(prompt)
    assert _chunks_of(drv, prompt) == [300]


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_capped_run_completes_everything_without_leaks(seed):
    rng = np.random.default_rng(seed)
    sched = Scheduler(BlockManager(24, 4), 6, 16, async_scheduling=True, max_prefill_beside_decodes=3)
    drv = Driver(sched, FakeWorkers(sched, seed), stop_prob=0.01, seed=seed, depth=2)
    pending = [make_seq(rng.integers(0, 1000, int(rng.integers(1, 60))).tolist(), max_tokens=20) for _ in range(80)]
    steps = 0
    while pending or drv.has_work:
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if drv.has_work:
            drv.step()
            check_invariants(sched)
            steps += 1
            assert steps < 5000, "no progress"
    assert_all_released(sched)


def test_servers_default_to_the_cap_and_the_flag_sets_it():
    assert engine_kwargs(parse_args([]))["max_prefill_beside_decodes"] == SERVER_PREFILL_BESIDE_DECODES
    given = parse_args(["--max-prefill-beside-decodes", "0"])
    assert engine_kwargs(given)["max_prefill_beside_decodes"] == 0
