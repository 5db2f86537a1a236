"""logit_bias on the worker: the sampler adds a step's (row, token, bias) entries before min_tokens masks and
penalties (vLLM's order), and the SamplingState keeps them in one sparse table that follows sequences into and out
of slots, so a step's entries are the rows sampled now and nothing is gathered while no sequence has a bias."""

from __future__ import annotations

import numpy as np
import torch

from coordinator.block_manager import BlockManager
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence
from protocol.codec import decode, encode
from protocol.messages import StepCommand
from protocol.sampling_params import SamplingParams
from tests.support.builders import vllm_penalized
from tests.worker.test_sampler import V, controls
from worker.sampler import apply_controls, sample, samples_on_shards
from worker.sampling_state import SamplingState
from worker.transfer import to_device

CPU = torch.device("cpu")


def _bias(rows, tokens, values) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor(rows), torch.tensor(tokens), torch.tensor(values, dtype=torch.float32)


def test_bias_is_added_to_its_pairs_only_and_steers_greedy_and_sampled_rows():
    rng = np.random.default_rng(1)
    logits = torch.from_numpy((rng.standard_normal((4, V)) * 2).astype(np.float32))
    top = logits.argmax(-1)
    st = controls(4, temperature=[0.0, 0.0, 0.8, 0.0])
    # row 0: +50 on token 5; row 2: +60 on token 9 (sampled row); row 3: -100 on its argmax; row 1 untouched
    st.logit_bias = _bias([0, 2, 3], [5, 9, int(top[3])], [50.0, 60.0, -100.0])
    got = apply_controls(logits, st)
    want = logits.clone()
    want[0, 5] += 50
    want[2, 9] += 60
    want[3, top[3]] -= 100
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, logits)  # a copy: the caller's logits are left alone
    tokens = sample(logits, st, torch.Generator().manual_seed(0))
    assert tokens[0] == 5 and tokens[1] == top[1] and tokens[2] == 9
    assert tokens[3] == logits[3].topk(2).indices[1]  # the second best once the best is pushed down
    assert not samples_on_shards(False, st)  # a biased batch needs the whole vocabulary on one rank


def test_bias_comes_before_penalties_as_in_vllm():
    """A repetition penalty divides a positive logit: the biased one, as vLLM applies logit bias first."""
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((1, V)) * 2).astype(np.float32)
    st = controls(1, temperature=0.0)
    st.logit_bias = _bias([0, 0], [3, 7], [4.0, -2.5])
    st.penalty_rows = torch.tensor([0])
    st.presence_penalty, st.frequency_penalty = torch.tensor([0.5]), torch.tensor([0.25])
    st.repetition_penalty = torch.tensor([1.7])
    st.output_counts = torch.from_numpy(np.bincount([3, 3, 9], minlength=V).astype(np.int32))[None]
    st.prompt_mask = torch.zeros(1, V, dtype=torch.bool)
    st.prompt_mask[0, 7] = True
    biased = logits[0].astype(np.float64)
    biased[3] += 4.0
    biased[7] -= 2.5
    want = vllm_penalized(biased, [7], [3, 3, 9], 0.5, 0.25, 1.7)
    np.testing.assert_allclose(apply_controls(torch.from_numpy(logits), st)[0].numpy(), want, rtol=1e-6, atol=1e-5)


def _state() -> SamplingState:
    return SamplingState(8, V, [2], CPU, lambda arr, dtype=torch.int64: to_device(arr, CPU, dtype))


def _start(state: SamplingState, sched: Scheduler, seqs: list[Sequence]) -> StepCommand:
    for seq in seqs:
        sched.add(seq)
    step = decode(encode(sched.schedule().step), expect=StepCommand)  # what a worker receives
    state.free(step.freed_slots)
    state.start(step.new_slots, step.new_params, step.new_num_outputs, step.new_prompt_lens, step.new_past_token_ids)
    return step


def _entries(state: SamplingState, sample_slots: list[int]) -> list[tuple[int, int, float]]:
    st = state.tensors(np.array(sample_slots), np.zeros(len(sample_slots), np.int64))
    if st.logit_bias is None:
        return []
    return sorted(zip(*(t.tolist() for t in st.logit_bias)))


def test_sparse_table_follows_sequences_into_and_out_of_slots():
    state, sched = _state(), Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=256)
    a = Sequence("a", [1, 2], 2, SamplingParams(logit_bias={5: 1.5, 40: -3.0}), 0.0)
    plain = Sequence("plain", [3, 4], 2, SamplingParams(), 0.0)
    b = Sequence("b", [5, 6], 2, SamplingParams(logit_bias={7: 2.0}, logprobs=1), 0.0)
    _start(state, sched, [a, plain, b])
    assert state.any_controls and state.has_bias.sum() == 2 and len(state.bias_slots) == 3
    # a step's entries name its rows (not slots), and only the rows sampled now
    assert _entries(state, [b.slot, plain.slot, a.slot]) == [(0, 7, 2.0), (2, 5, 1.5), (2, 40, -3.0)]
    assert _entries(state, [plain.slot, b.slot]) == [(1, 7, 2.0)]
    assert _entries(state, [plain.slot]) == []
    # a leaves; a new sequence reuses its slot: the table holds b's entry and the newcomer's
    a_slot = a.slot
    sched.finish(a, "stop")
    c = Sequence("c", [8, 9], 2, SamplingParams(logit_bias={11: -1.0}), 0.0)
    step = _start(state, sched, [c])
    assert step.freed_slots.tolist() == [a_slot] and c.slot == a_slot
    assert sorted(zip(state.bias_slots.tolist(), state.bias_tokens.tolist())) == sorted([(b.slot, 7), (c.slot, 11)])
    # the last one reuses the slot without a bias: nothing of c's survives
    sched.finish(c, "stop")
    d = Sequence("d", [8, 9], 2, SamplingParams(temperature=0.5), 0.0)
    _start(state, sched, [d])
    assert d.slot == a_slot and state.bias_slots.tolist() == [b.slot] and not state.has_bias[d.slot]
    state.free(np.array([b.slot], np.int32))
    assert not state.any_controls and len(state.bias_slots) == 0 and not state.has_bias.any()
