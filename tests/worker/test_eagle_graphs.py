"""The EAGLE-3 draft's graphs (worker/eagle_graphs.py) on the real model runner, without CUDA: the same static
buffers, padding to a batch bucket, on-device step counter, positions, block-table lookups and draft writes, with each
"replay" run eagerly. Two runners take the same StepCommands (prefills, verify rows of different draft counts, decode
steps, a mixed step); the one drafting through the graphs' buffers fills the same drafts, samples the same tokens
and keeps the same first drafts and hidden states as the eager drafter. tests/engine/test_speculative_gpu.py runs
``side_by_side`` with real CUDA graphs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from model.tiny import write_tiny_checkpoint
from protocol.codec import decode, encode
from protocol.messages import DRAFT_PLACEHOLDER, StepCommand
from tests.model.test_families import FAMILIES
from tests.support.builders import i32, make_step, worker_config
from tests.support.tiny_eagle3 import DraftSpec, write_tiny_eagle3
from worker.model_runner import ModelRunner

P = DRAFT_PLACEHOLDER


def _wire(step: StepCommand, draft_counts=None) -> StepCommand:
    step.draft_counts = None if draft_counts is None else i32(draft_counts)
    return decode(encode(step), expect=StepCommand)  # what a worker receives


def _start(slot: int, prompt: list[int]) -> dict:
    return dict(slot=slot, tokens=prompt, start=0, new_blocks=list(range(slot * 8, slot * 8 + 8)))


def _verify(slot: int, d: int) -> dict:
    return dict(slot=slot, tokens=[-1] + [P] * d)  # the async feed's last token, then d drafts to fill


def steps(rng: np.random.Generator) -> list[tuple[list[dict], list[int] | None]]:
    """(rows, draft counts) of each step: decode-laid verify steps (<= 16 tokens: the catch-up graph too), a
    decode-only step, a mixed step with a prompt (fill graph, eager catch-up), and drafts of one only (no replay)."""
    prompts = [rng.integers(0, 500, n).tolist() for n in (21, 30, 12, 9)]
    return [
        ([_start(s, prompts[s]) for s in range(3)], None),
        ([_verify(0, 3), _verify(1, 1), _verify(2, 2)], [3, 1, 2]),
        ([dict(slot=s, tokens=[-1]) for s in range(3)], None),
        ([_start(3, prompts[3]), _verify(0, 2), _verify(1, 3), dict(slot=2, tokens=[-1])], [0, 2, 3, 0]),
        ([_verify(s, 3) for s in range(4)], [3, 3, 3, 3]),
        ([_verify(s, 1) for s in range(4)], [1, 1, 1, 1]),
        ([_verify(1, 2), _verify(3, 3)], [2, 3]),
    ]


def side_by_side(target, draft, device: str, accept_all: bool, hidden_tol: float = 1e-5, **cfg) -> dict:
    """Runs ``steps`` on an eager-drafting runner and one drafting through DraftGraphs (CUDA: captured by the start-up
    path with the target's graphs; CPU: run eagerly on the graphs' buffers); asserts they agree step by step and
    returns the graphs' replay counts. ``hidden_tol``: of the largest hidden value."""
    runners = []
    for graphs in (False, True):
        config = worker_config(target, draft_model=str(draft), device=device, max_num_seqs=16, block_size=8, **cfg)
        if device == "cuda":
            config = dataclasses.replace(config, attention_backend="triton", enforce_eager=not graphs)
        r = ModelRunner(config, torch.device(device))
        r.allocate_kv(64)
        r.accept_all_drafts = accept_all  # every draft kept: later steps attend over the drafts' K/V
        if graphs and device == "cuda":
            from worker.startup import capture_graphs

            capture_graphs(r)
        elif graphs:
            r.drafter.capture_graphs(capture=False)
        runners.append(r)
    eager, graphed = runners
    assert eager.drafter.graphs is None and graphed.drafter.graphs is not None
    for i, (rows, drafts) in enumerate(steps(np.random.default_rng(4))):
        got = []
        for r in runners:
            done = r.launch(_wire(make_step(rows, i), drafts))
            got.append((done.wait().tolist(), r.step_ids.tolist()))
        assert got[0] == got[1], f"step {i}: (tokens, ids) eager {got[0]} != graphs {got[1]}"
        assert P not in got[1][1] and -1 not in got[1][1]
        assert torch.equal(eager.drafter.first, graphed.drafter.first), f"step {i}"
        # the graphs run the draft over a padded bucket, eagerly over the rows that draft: float32 rounding only
        scale = eager.drafter.hidden.abs().max().item()
        torch.testing.assert_close(graphed.drafter.hidden, eager.drafter.hidden, atol=hidden_tol * scale, rtol=0)
    g = graphed.drafter.graphs
    return {"fill": g.fill_replays, "catch_up": g.catch_up_replays}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_graphs")
    target = write_tiny_checkpoint(root / "t", dataclasses.replace(FAMILIES["llama"], num_hidden_layers=4))
    return target, write_tiny_eagle3(root / "d", target, DraftSpec(draft_vocab_size=400, std=0.3))


@pytest.mark.parametrize("accept_all", [False, True])
def test_draft_graph_buffers_draft_as_the_eager_drafter(checkpoints, accept_all):
    replays = side_by_side(*checkpoints, "cpu", accept_all)
    # fills: 2 + 2 (step 3: d max 3) + 2 + 0 (drafts of one) + 2; catch-ups: steps 1, 2, 4, 5, 6 (no prompt rows)
    assert replays == {"fill": 8, "catch_up": 5}
