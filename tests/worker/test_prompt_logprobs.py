"""Prompt logprobs on the worker, through a real ModelRunner on a float32 tiny checkpoint against HF transformers'
teacher-forced log-softmax: each chunk of a prompt returns the positions its rows predict (the last row of a chunk
predicts the next chunk's first token, known from the prompt the start record carries), with the prompt token's
rank and the top N; other sequences of the step return nothing; a restart returns positions from its first
recomputed row on, and a restart after the prompt completed (outputs already) returns none."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.builders import make_step, worker_config
from worker.model_runner import ModelRunner

N = 3


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return np.random.default_rng(11).integers(0, 500, 21).tolist()


@pytest.fixture(scope="module")
def hf_logprobs(tiny_tied, prompt) -> torch.Tensor:
    """[len(prompt), vocab] float64 log-softmax of HF's logits: row q predicts prompt[q + 1]."""
    model = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)


def _runner(model_dir) -> ModelRunner:
    r = ModelRunner(worker_config(model_dir, block_size=8), torch.device("cpu"))
    r.allocate_kv(32)
    return r


def _run(runner: ModelRunner, rows: list[dict], step_id: int = 0, freed=()) -> list[tuple]:
    """One step; its prompt logprobs as (row, position, rank, ids, logprobs) per position."""
    pending = runner.launch(make_step(rows, step_id=step_id, freed=freed))
    pending.wait()
    index, ids, values = pending.prompt_result()
    if index is None:
        return []
    out, offset = [], 0
    for row, position, rank in index.reshape(-1, 3).tolist():
        end = offset + 1 + N
        out.append((row, position, rank, ids[offset:end].tolist(), values[offset:end].tolist()))
        offset = end
    assert offset == len(ids) == len(values)
    return out


def _check(entries: list[tuple], prompt: list[int], lp: torch.Tensor, row: int, positions: range) -> None:
    assert [e[1] for e in entries] == list(positions) and all(e[0] == row for e in entries)
    for _, p, rank, ids, values in entries:
        dist, token = lp[p - 1], prompt[p]
        assert ids[0] == token and values[0] == pytest.approx(dist[token].item(), abs=1e-4)
        assert rank == int((dist >= dist[token]).sum())  # vLLM's rank: tokens at least as likely, itself included
        top = dist.topk(N)
        assert ids[1:] == top.indices.tolist()
        np.testing.assert_allclose(values[1:], top.values.numpy(), atol=1e-4)


def test_chunked_prompt_returns_every_position_once_with_hf_values(tiny_tied, prompt, hf_logprobs):
    r = _runner(tiny_tied)
    rng = np.random.default_rng(3)
    asks = dict(slot=2, start=0, prompt_logprobs=N, penalty_prompt=prompt)  # penalty_prompt: the prompt sent
    other = dict(slot=5, tokens=rng.integers(0, 500, 6).tolist(), start=0, new_blocks=[20])
    # chunks of 8, 8 and 5 tokens; the plain sequence shares the first step (row 1) and decodes in the next ones
    first = _run(r, [dict(asks, tokens=prompt[:8], new_blocks=[0], sample=False), other])
    _check(first, prompt, hf_logprobs, row=0, positions=range(1, 9))  # row 7 predicts prompt[8], next chunk's
    second = _run(r, [dict(slot=2, tokens=prompt[8:16], new_blocks=[1], sample=False), dict(slot=5, tokens=[1])], 1)
    _check(second, prompt, hf_logprobs, row=0, positions=range(9, 17))
    third = _run(r, [dict(slot=2, tokens=prompt[16:], new_blocks=[2]), dict(slot=5, tokens=[2])], 2)
    _check(third, prompt, hf_logprobs, row=0, positions=range(17, 21))  # the last row predicts an output
    assert not r.prompt_logprobs.prompts  # the prompt is done: later steps of the slot look nothing up
    assert _run(r, [dict(slot=5, tokens=[3]), dict(slot=2, tokens=[4])], 3) == []


def test_restarts_return_positions_from_the_first_recomputed_row(tiny_tied, prompt, hf_logprobs):
    r = _runner(tiny_tied)
    asks = dict(slot=1, prompt_logprobs=N, penalty_prompt=prompt)
    # preempted after 8 prompt tokens; readmitted with its first block from the prefix cache (start=8)
    _run(r, [dict(asks, tokens=prompt[:8], start=0, new_blocks=[0], sample=False)])
    got = _run(r, [dict(asks, tokens=prompt[8:], start=8, new_blocks=[0, 1, 2])], 1, freed=[1])
    _check(got, prompt, hf_logprobs, row=0, positions=range(9, 21))
    # preempted with outputs: the prompt was done, so the recomputation returns none (the coordinator sends
    # the prompt only while no output exists; a repetition penalty sends it anyway)
    out = dict(slot=1, tokens=prompt + [7, 8], start=0, new_blocks=[3, 4, 5], outputs=[7, 8, 9])
    assert _run(r, [dict(out, prompt_logprobs=N, repetition_penalty=1.2, penalty_prompt=prompt)], 2, [1]) == []
    assert not r.prompt_logprobs.prompts
