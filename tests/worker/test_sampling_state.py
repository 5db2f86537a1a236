"""A request's SamplingParams from the scheduler to the worker's per-slot arrays: the scheduler builds a
StepCommand for sequences that start in a slot (one fresh, one restarting after a preemption), it travels as
msgpack bytes, and worker/sampling_state.py derives every per-slot control from the records (min_tokens still
pending, masked ids, seeds, penalties with their history, logprobs)."""

from __future__ import annotations

import numpy as np
import torch

from coordinator.block_manager import BlockManager
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence
from protocol.codec import decode, encode
from protocol.messages import StepCommand
from protocol.sampling_params import SamplingParams
from worker.sampling_state import SamplingState
from worker.transfer import to_device

VOCAB = 64
EOS = [2, 61]
CPU = torch.device("cpu")


def _state(max_num_seqs: int = 8) -> SamplingState:
    return SamplingState(max_num_seqs, VOCAB, EOS, CPU, lambda arr, dtype=torch.int64: to_device(arr, CPU, dtype))


def _start(state: SamplingState, step: StepCommand) -> None:
    state.free(step.freed_slots)
    state.start(step.new_slots, step.new_params, step.new_num_outputs, step.new_prompt_lens, step.new_past_token_ids)


def _scheduled_step(seqs: list[Sequence]) -> StepCommand:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=256)
    for seq in seqs:
        sched.add(seq)
    step = sched.schedule().step
    assert [s.slot for s in seqs] == step.new_slots.tolist()
    return decode(encode(step), expect=StepCommand)  # what a worker receives


def test_new_sequences_travel_as_records_into_the_sampling_state():
    plain = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=2**40 + 3)
    # min_tokens=3 masks the stop id and the EOS ids (EOS unless ignore_eos)
    banned = SamplingParams(min_tokens=3, max_tokens=8, stop_token_ids=[9, 2])
    # a preempted sequence: 3 outputs already, so 1 of its 4 min_tokens is pending; penalties count its prompt
    # (repetition) and outputs; ignore_eos leaves only its stop id masked
    preempted = SamplingParams(
        min_tokens=4, max_tokens=8, stop_token_ids=[30], ignore_eos=True, repetition_penalty=1.5,
        frequency_penalty=0.25, presence_penalty=-0.5, logprobs=2,
    )  # fmt: skip
    done = SamplingParams(min_tokens=2, max_tokens=8, logprobs=0)  # preempted after 2 outputs: nothing pending
    prompt, outputs = [5, 6, 7, 5, 8], [11, 11, 40]
    seqs = [
        Sequence("plain", [1, 2, 3], 3, plain, 0.0),
        Sequence("sampled", [4, 5], 2, sampled, 0.0),
        Sequence("banned", [6, 7, 8], 3, banned, 0.0),
        Sequence("preempted", prompt + outputs, len(prompt), preempted, 0.0),
        Sequence("done", [9, 10, 12, 13], 2, done, 0.0),
    ]
    step = _scheduled_step(seqs)
    assert step.new_params == [plain, sampled, banned, preempted, done]
    assert step.new_num_outputs.tolist() == [0, 0, 0, 3, 2]
    assert step.new_prompt_lens.tolist() == [0, 0, 0, 5, 0]  # only a repetition penalty needs the prompt
    assert step.new_past_token_ids.tolist() == prompt + outputs + [12, 13]

    state = _state()
    _start(state, step)
    slot = {s.request_id: s.slot for s in seqs}
    s_plain, s_sampled, s_banned, s_pre, s_done = (slot[s.request_id] for s in seqs)
    assert state.temperature[s_plain] == 0 and state.seed[s_plain] == -1 and state.top_k[s_plain] == 0
    assert state.temperature[s_sampled] == np.float32(0.7) and state.top_p[s_sampled] == np.float32(0.9)
    assert state.top_k[s_sampled] == 5 and state.min_p[s_sampled] == np.float32(0.05)
    assert state.seed[s_sampled] == 2**40 + 3
    assert state.min_tokens_left[[s_plain, s_banned, s_pre, s_done]].tolist() == [0, 3, 1, 0]
    assert sorted(state.stop_ids[s_banned][state.stop_ids[s_banned] >= 0].tolist()) == [2, 9, 61]
    assert state.stop_ids[s_pre][state.stop_ids[s_pre] >= 0].tolist() == [30]
    assert state.has_penalty.tolist().count(True) == 1 and state.has_penalty[s_pre]
    assert state.repetition_penalty[s_pre] == 1.5 and state.frequency_penalty[s_pre] == 0.25
    assert state.presence_penalty[s_pre] == -0.5
    assert state.num_logprobs[[s_plain, s_pre, s_done]].tolist() == [-1, 2, 0]
    assert state.any_controls
    # the penalty history: the prompt as a mask, the outputs as counts (the unpenalized outputs count nowhere)
    assert np.flatnonzero(state.prompt_mask[s_pre].numpy()).tolist() == [5, 6, 7, 8]
    assert state.output_counts[s_pre].numpy()[[11, 40]].tolist() == [2, 1] and state.output_counts[s_pre].sum() == 3
    assert state.output_counts.sum() == 3 and state.prompt_mask.sum() == 4

    # a step's tensors: bans for the rows with min_tokens pending, penalties for the penalized row
    sample_slots = np.array([s_plain, s_banned, s_pre, s_done])
    st = state.tensors(sample_slots, np.array([3, 3, 8, 4]))
    rows, ids = (t.tolist() for t in st.banned)
    assert sorted(zip(rows, ids)) == [(1, 2), (1, 9), (1, 61), (2, 30)]
    assert st.penalty_rows.tolist() == [2] and st.output_counts.shape == (1, VOCAB)
    tokens = torch.tensor([0, 1, 11, 3])
    state.after_sample(st, sample_slots, torch.from_numpy(sample_slots), tokens)
    assert state.min_tokens_left[[s_banned, s_pre]].tolist() == [2, 0]
    assert state.output_counts[s_pre, 11] == 3

    # freeing the slots resets their controls; no slot uses one any more
    state.free(np.array(sorted(slot.values()), np.int32))
    assert not state.any_controls and not state.min_tokens_left.any() and (state.num_logprobs == -1).all()


def test_a_reused_slot_forgets_its_previous_sequence():
    state = _state()
    step = _scheduled_step([Sequence("a", [1, 2], 2, SamplingParams(presence_penalty=1.0, logprobs=1), 0.0)])
    _start(state, step)
    s = int(step.new_slots[0])
    assert state.any_controls and state.has_penalty[s]
    # the next sequence in that slot uses no control: the slot's state is reset, no slot pays for controls
    reuse = Sequence("b", [3, 4], 2, SamplingParams(temperature=0.5, seed=7), 0.0)
    step = _scheduled_step([reuse])
    assert int(step.new_slots[0]) == s
    _start(state, step)
    assert not state.any_controls and not state.has_penalty[s] and state.num_logprobs[s] == -1
    assert state.temperature[s] == 0.5 and state.seed[s] == 7
