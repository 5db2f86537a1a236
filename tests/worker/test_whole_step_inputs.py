"""The whole-step path of the prefill graphs on the CPU (Triton interpreter), all but the capture: the real model
runner lays each step out (HostBatch.attention_rows), WholeStepInputs fills the static buffers padded to the
graphs' token bucket, and the forward runs eagerly under the whole-step attention over them. Its logits equal the
runner's ordinary eager forward (the torch attention backend) on prefills, chunks over a cached prefix, mixed
prefill + decode steps and decode-only steps, step after step over the same KV cache."""

from __future__ import annotations

import bisect

import numpy as np
import pytest
import torch

from model.context import forward_context
from tests.support.builders import make_step, worker_config
from tests.support.oracle import rel_err
from worker.model_runner import ModelRunner
from worker.prefill_graphs import token_buckets
from worker.startup import runner_inputs


class EagerWholeStep:
    """PrefillGraphs' ``holds``/``run`` without the capture: the same inputs, the forward run eagerly."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.buckets = runner, token_buckets(runner.cfg.max_num_batched_tokens)
        self.inputs = runner_inputs(runner)
        self.padded: list[int] = []

    def holds(self, num_tokens: int, num_seqs: int) -> bool:
        return self.inputs.holds(num_tokens, num_seqs)

    def run(self, stager, input_ids, positions, slot_mapping, *rows) -> torch.Tensor:
        n = len(input_ids)
        tokens = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.padded.append(tokens)
        self.inputs.load(stager, input_ids, positions, slot_mapping, *rows, tokens)
        i = self.inputs
        with forward_context(i.meta(tokens), i.attention(self.runner.backend.store_kvcache)):
            return self.runner.model(i.input_ids[:tokens], i.positions[:tokens])[:n]


def _steps(rng) -> list[list[dict]]:
    a, b, c, d = (rng.integers(0, 500, n).tolist() for n in (40, 20, 70, 33))
    return [
        [dict(slot=0, tokens=a, start=0, new_blocks=[0, 1, 2]), dict(slot=1, tokens=b[:12], start=0, new_blocks=[3])],
        # the rest of b over its cached 12 tokens, a new prompt, a decode row
        [
            dict(slot=1, tokens=b[12:], new_blocks=[4]),
            dict(slot=2, tokens=c, start=0, new_blocks=[5, 6, 7, 8, 9]),
            dict(slot=0, tokens=[7]),
        ],
        [dict(slot=3, tokens=d, start=0, new_blocks=[10, 11, 12]), dict(slot=0, tokens=[8]), dict(slot=2, tokens=[9])],
        [dict(slot=s, tokens=[int(t)]) for s, t in zip(range(4), rng.integers(0, 500, 4))],  # decode rows only
    ]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton on CPU tensors: the interpreter (tests/engine/test_gpu_e2e.py)"
)
def test_whole_step_forwards_match_the_eager_forward(tiny_untied):
    steps = _steps(np.random.default_rng(5))
    logits = {}
    for whole_step in (False, True):
        runner = ModelRunner(worker_config(tiny_untied, max_num_batched_tokens=256), torch.device("cpu"))
        runner.allocate_kv(64)
        stand_in = runner.prefill_graphs = EagerWholeStep(runner) if whole_step else None
        logits[whole_step] = [runner.forward_logits(make_step(s, step_id=i)) for i, s in enumerate(steps)]
    assert stand_in.padded == [64, 128, 64, 16]  # 52, 99, 35 and 4 tokens, each padded to its bucket
    for got, want in zip(logits[True], logits[False]):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_token_buckets_are_fine_where_mixed_steps_fall_and_end_at_the_budget():
    assert token_buckets(8192) == [16, 32, 64, 128, 192, 256, 288, 320, 352, 384, 512, 768] + list(
        range(1024, 8193, 1024)
    )
    assert token_buckets(300) == [16, 32, 64, 128, 192, 256, 288, 300]  # the budget itself is the last
