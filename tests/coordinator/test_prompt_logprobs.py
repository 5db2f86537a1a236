"""Prompt logprobs on the coordinator: the scheduler sends a sequence's prompt while its prompt logprobs are still
to compute and keeps prefix-cache hits off the positions nobody computed for it (vLLM skips the cache for such
requests; after a preemption only what it computed before may be revived), and the output processor builds
vLLM's list (None, then {id: Logprob}) from the steps' entries, dropping positions a restart computed again."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from coordinator.output_processor import OutputProcessor
from coordinator.sequence import Sequence
from protocol.outputs import Logprob
from protocol.sampling_params import SamplingParams
from tests.support.scheduler_driver import assert_all_released, make_seq, new_scheduler

PROMPT = list(range(100, 124))  # 24 tokens: 6 blocks of 4


def _new(batch, seq) -> tuple[int, int]:
    """(start position, prompt ids sent) of ``seq`` starting in this step."""
    i = batch.step.new_slots.tolist().index(seq.slot)
    return int(batch.step.new_start_pos[i]), int(batch.step.new_prompt_lens[i])


def test_prompt_sent_and_cache_hits_capped_until_the_prompt_is_done():
    sched, drv = new_scheduler(64, 4, budget=8)
    warm = make_seq(PROMPT, max_tokens=1)
    sched.add(warm)
    drv.run_to_end()  # the whole prompt is now in the prefix cache
    asks = Sequence("asks", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=3, prompt_logprobs=2), 0.0)
    plain = make_seq(PROMPT, max_tokens=3)
    sched.add(asks)
    sched.add(plain)
    batch = drv.step()
    assert batch.seqs == [asks]  # its first chunk takes the whole budget: nothing cached for it
    assert _new(batch, asks) == (0, len(PROMPT)) and asks.prompt_logprobs_upto == 8
    batch = drv.step()  # its second chunk
    assert asks.prompt_logprobs_upto == 16
    # preempted mid-prompt: readmitted with the cache only up to the positions already computed for it
    sched.running.remove(asks)
    sched.preempt(asks)
    while asks.status.name == "WAITING":
        batch = drv.step()
    start, sent = _new(batch, asks)
    assert start == 16 and sent == len(PROMPT)  # 20 are cached, 16 were computed for it
    while not asks.output_token_ids:
        drv.step()
    assert asks.prompt_logprobs_upto == len(PROMPT) - 1 and asks.status.name == "RUNNING"
    # preempted with outputs: its prompt logprobs are done, so the cache serves it whole and no prompt is sent
    sched.running.remove(asks)
    sched.preempt(asks)
    while asks.status.name == "WAITING":
        batch = drv.step()
    start, sent = _new(batch, asks)
    assert start == 24 and sent == 0
    assert plain.num_cached_tokens == 20  # a request without prompt logprobs shares the cache as always
    drv.run_to_end()
    assert_all_released(sched)


@pytest.fixture(scope="module")
def tok(tiny_tied):
    return AutoTokenizer.from_pretrained(tiny_tied)


def _entries(rows_positions_ranks, n: int, first_id: int):
    """A step's StepResult prompt fields for (row, position, rank) triples, N = n: distinct ids from
    ``first_id`` on, logprob -(id - first_id) / 8 (exact in float32)."""
    index = np.array(rows_positions_ranks, np.int32).reshape(-1)
    ids = np.arange(first_id, first_id + len(rows_positions_ranks) * (1 + n), dtype=np.int32)
    return index, ids, (first_id - ids).astype(np.float32) / 8


def test_output_processor_builds_vllms_list_once_per_position(tok):
    proc = OutputProcessor(tok)
    seq = Sequence("r", [5, 6, 7, 8, 9], 5, SamplingParams(max_tokens=1, prompt_logprobs=1), 0.0)
    other = Sequence("o", [1, 2], 2, SamplingParams(max_tokens=1), 0.0)
    assert not proc.add(seq, stream=False)  # prompt logprobs alone need no per-token updates
    proc.add(other, stream=False)
    proc.add_prompt_logprobs([other, seq], *_entries([(1, 1, 3), (1, 2, 1)], 1, 300))  # row 1 is seq's
    # a restart after a preemption computes position 2 again: that copy is dropped
    proc.add_prompt_logprobs([seq], *_entries([(0, 2, 7), (0, 3, 2), (0, 4, 1)], 1, 400))
    seq.token_ids.append(11)
    out = proc.update(seq, 11, None, ("length", None))
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == 5 and out.completion().prompt_logprobs is pl
    expect = {1: (300, 3), 2: (302, 1), 3: (402, 2), 4: (404, 1)}  # position: (prompt-token id, its rank)
    for p, (token, rank) in expect.items():
        base = 300 if token < 400 else 400
        # vLLM's entry: the prompt token (its own rank), then the top N ranked 1..N, each with its own text
        assert pl[p] == {
            token: Logprob(-(token - base) / 8, rank, tok.decode([token])),
            token + 1: Logprob(-(token + 1 - base) / 8, 1, tok.decode([token + 1])),
        }
        assert list(pl[p]) == [token, token + 1]
    # a position after a gap is a bug: said, not hidden
    late = Sequence("late", [5, 6, 7, 8], 4, SamplingParams(prompt_logprobs=0), 0.0)
    proc.add(late, stream=True)
    with pytest.raises(RuntimeError, match="prompt logprob 3 before 1"):
        proc.add_prompt_logprobs([late], *_entries([(0, 3, 1)], 0, 450))
