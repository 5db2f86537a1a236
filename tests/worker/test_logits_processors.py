"""worker/logits_processors.py through the worker's SamplingState and sampler: a record with allowed_token_ids
(decoded from the wire, as a worker receives it) restricts its own row only, a slot reused by a sequence without
them samples freely again, and a batch without any costs no controls."""

from __future__ import annotations

import numpy as np
import torch

from protocol.codec import decode, encode
from protocol.sampling_params import SamplingParams
from worker.sampler import sample
from worker.sampling_state import SamplingState
from worker.transfer import to_device

VOCAB = 64
CPU = torch.device("cpu")


def _state(max_num_seqs: int = 4) -> SamplingState:
    return SamplingState(max_num_seqs, VOCAB, [2], CPU, lambda arr, dtype=torch.int64: to_device(arr, CPU, dtype))


def _start(state: SamplingState, slots: list[int], params: list[SamplingParams]) -> None:
    params = [decode(encode(p)) for p in params]  # what a worker receives
    n = len(slots)
    zeros = np.zeros(n, dtype=np.int32)
    state.start(np.array(slots, dtype=np.int32), params, zeros, zeros, np.zeros(0, dtype=np.int32))


def _sample(state: SamplingState, slots: list[int], logits: torch.Tensor) -> list[int]:
    slots = np.array(slots, dtype=np.int64)
    st = state.tensors(slots, np.zeros(len(slots), dtype=np.int64))
    return sample(logits, st, torch.Generator().manual_seed(0)).tolist()


def test_allowed_token_ids_restrict_their_row_and_leave_with_their_sequence():
    state = _state()
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[:, 40] = 50.0  # every row's argmax, never in the allowed lists
    allowed = [7, 11, 63]
    _start(state, [0, 1, 2], [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[5]),
    ])  # fmt: skip
    assert state.any_controls
    got = _sample(state, [0, 1, 2], logits)
    assert got[0] == 40  # an unrestricted row keeps its argmax
    assert got[1] == allowed[int(logits[1, allowed].argmax())]  # greedy among the allowed ids
    assert got[2] == 5  # sampled, but only one id is allowed
    for seed in range(20):  # sampled rows never leave the allowed set
        _start(state, [3], [SamplingParams(temperature=2.0, seed=seed, allowed_token_ids=allowed)])
        assert _sample(state, [3], logits[:1])[0] in allowed
    # the sequences leave; a new sequence in slot 1 is unrestricted, and a batch without any costs nothing
    state.free(np.array([0, 1, 2, 3], dtype=np.int32))
    assert not state.any_controls
    _start(state, [1], [SamplingParams(temperature=0)])
    assert not state.any_controls and _sample(state, [1], logits[1:2]) == [40]
    # a slot reused without free (the coordinator frees before it reuses, but start resets what it sets)
    _start(state, [1], [SamplingParams(temperature=0, allowed_token_ids=[9])])
    assert _sample(state, [1], logits[1:2]) == [9]
    _start(state, [1], [SamplingParams(temperature=0)])
    assert _sample(state, [1], logits[1:2]) == [40] and not state.any_controls
