"""worker/sampler.py's penalties (vLLM's formula) and min_tokens bans, and sampling through a real ModelRunner on a
tiny checkpoint: a seeded request samples the same alone and batched, the per-slot penalty state follows the
steps, and each sampler path gets only the controls it reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.builders import make_step, vllm_penalized, worker_config
from tests.support.controls import controls
from worker.sampler import SamplingTensors, sample

V = 48


# ---- through the model runner ----------------------------------------------------------------------------


def _runner(model_dir):
    from worker.model_runner import ModelRunner

    r = ModelRunner(worker_config(model_dir), torch.device("cpu"))
    r.allocate_kv(64)
    return r


def _generate(runner, schedule: list[list[dict]], n_steps: int, target_slot: int) -> list[int]:
    """Drive the runner: ``schedule[i]`` are the sequences that join at step i (dicts for make_step with a
    full prompt); afterwards every sequence decodes its last sampled token. Returns the target's tokens."""
    bs = runner.block_size
    live: dict[int, dict] = {}
    out: list[int] = []
    for step_id in range(n_steps):
        rows = []
        for s in schedule[step_id] if step_id < len(schedule) else []:
            live[s["slot"]] = dict(s, length=len(s["tokens"]))
            rows.append(dict(s))
        decodes = []
        for slot, s in live.items():
            if "last" in s:
                blocks = []
                if s["length"] % bs == 0:  # the new token starts a block
                    blocks = [s["spare"].pop(0)]
                decodes.append(dict(slot=slot, tokens=[s["last"]], new_blocks=blocks))
                s["length"] += 1
        step_rows = rows + decodes  # prefill-first, as the scheduler sends them
        tokens = runner.execute(make_step(step_rows, step_id=step_id)).tolist()
        for row, tok in zip(step_rows, tokens):
            live[row["slot"]]["last"] = tok
            if row["slot"] == target_slot:
                out.append(tok)
    return out


def test_model_runner_seeded_request_same_alone_and_batched(tiny_tied):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 500, 21).tolist()
    target = dict(tokens=prompt, start=0, temperature=1.5, seed=4242)

    alone = _generate(_runner(tiny_tied), [[dict(target, slot=0, new_blocks=[0, 1], spare=[2, 3])]], 8, target_slot=0)
    assert len(alone) == 8

    others = [
        dict(slot=1, tokens=rng.integers(0, 500, 40).tolist(), start=0, temperature=1.0, new_blocks=[10, 11, 12]),
        dict(slot=2, tokens=rng.integers(0, 500, 5).tolist(), start=0, temperature=0.0, new_blocks=[20]),
        dict(slot=3, tokens=rng.integers(0, 500, 30).tolist(), start=0, temperature=2.0, seed=7, new_blocks=[30, 31]),
    ]
    for o in others:
        o["spare"] = [b + 5 for b in o["new_blocks"]]
    late = dict(slot=4, tokens=rng.integers(0, 500, 17).tolist(), start=0, temperature=1.0, new_blocks=[40, 41])
    late["spare"] = [42, 43]
    batched = _generate(
        _runner(tiny_tied),
        [
            [others[0], dict(target, slot=6, new_blocks=[51, 50], spare=[52, 53]), others[1], others[2]],
            [],
            [late],  # a prefill joins while the target decodes
        ],
        8,
        target_slot=6,
    )
    assert batched == alone

    # the seed is what makes it reproducible: another seed gives another continuation
    other_seed = _generate(
        _runner(tiny_tied),
        [[dict(target, seed=4243, slot=0, new_blocks=[0, 1], spare=[2, 3])]],
        8,
        target_slot=0,
    )
    assert other_seed != alone


# ---- min_tokens masks and penalties (vLLM semantics) -----------------------------------------------------


PENALTY_ROWS = [  # (prompt tokens, output tokens, presence, frequency, repetition)
    ([1, 2, 3], [3, 3, 7, 9], 0.0, 0.0, 1.7),
    ([], [5, 5, 5, 11], 0.0, 0.6, 1.0),
    ([4], [5, 6, 6], 1.1, 0.0, 1.0),
    ([0, 8, 40], [8, 12, 12, 30, 47], -0.5, 0.4, 0.6),  # a repetition penalty < 1 rewards repeats
    ([2, 2, 20], [], 2.0, -2.0, 10.0),  # outputs empty: only the prompt is penalized (by repetition)
]


def penalty_controls(n: int, rows: list[int], specs, temperature=0.0) -> SamplingTensors:
    st = controls(n, temperature=temperature)
    counts = torch.zeros(len(rows), V, dtype=torch.int32)
    mask = torch.zeros(len(rows), V, dtype=torch.bool)
    for i, (prompt, output, *_) in enumerate(specs):
        counts[i] = torch.from_numpy(np.bincount(np.asarray(output, dtype=np.int64), minlength=V).astype(np.int32))
        mask[i, prompt] = True
    st.penalty_rows = torch.tensor(rows)
    st.presence_penalty = torch.tensor([s[2] for s in specs], dtype=torch.float32)
    st.frequency_penalty = torch.tensor([s[3] for s in specs], dtype=torch.float32)
    st.repetition_penalty = torch.tensor([s[4] for s in specs], dtype=torch.float32)
    st.output_counts, st.prompt_mask = counts, mask
    return st


def test_penalties_match_vllm_formula():
    from worker.sampler import apply_controls

    rng = np.random.default_rng(12)
    n = len(PENALTY_ROWS) + 2
    logits = (rng.standard_normal((n, V)) * 3).astype(np.float32)
    rows = [0, 2, 3, 5, 6]  # rows 1 and 4 have no penalty and must stay untouched
    st = penalty_controls(n, rows, PENALTY_ROWS)
    got = apply_controls(torch.from_numpy(logits), st).numpy()
    for r, spec in zip(rows, PENALTY_ROWS):
        want = vllm_penalized(logits[r], *spec)
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-5)
        assert not np.allclose(got[r], logits[r])  # each case really changes something
    np.testing.assert_array_equal(got[[1, 4]], logits[[1, 4]])
    # greedy picks the argmax of the penalized logits; the input logits are left as they were
    before = logits.copy()
    tokens = sample(torch.from_numpy(logits), st).numpy()
    np.testing.assert_array_equal(logits, before)
    np.testing.assert_array_equal(tokens, got.argmax(-1))
    assert (tokens[rows] != before[rows].argmax(-1)).any()


def test_banned_tokens_are_never_sampled_and_others_untouched():
    """min_tokens bans: (row, token) pairs at -inf, before penalties, for greedy and sampled rows alike."""
    rng = np.random.default_rng(3)
    n = 600
    logits = torch.from_numpy(np.tile((rng.standard_normal(V) * 2).astype(np.float32), (n, 1)))
    top = int(logits[0].argmax())
    temperature = np.where(np.arange(n) % 2 == 0, 0.0, 0.7)
    st = controls(n, temperature=temperature)
    banned_rows = np.arange(0, n, 3)  # every third row may not emit the top token nor token 0
    st.banned = (
        torch.from_numpy(np.repeat(banned_rows, 2)),
        torch.from_numpy(np.tile([top, 0], len(banned_rows))),
    )
    got = sample(logits, st, torch.Generator().manual_seed(0)).numpy()
    is_banned = np.zeros(n, bool)
    is_banned[banned_rows] = True
    assert not np.isin(got[is_banned], [top, 0]).any()
    assert (got[~is_banned & (temperature == 0)] == top).all()
    assert (got[~is_banned & (temperature > 0)] == top).mean() > 0.2  # the unbanned sampled rows still pick it
    second = next(int(t) for t in np.argsort(-logits[0].numpy()) if t not in (top, 0))
    assert (got[is_banned & (temperature == 0)] == second).all()


def test_runner_penalty_state_and_min_tokens_through_steps(tiny_tied):
    """The runner's per-slot state: penalty counts and prompt mask allocated only when a penalized sequence
    arrives, filled from the tokens the new record carries (prefix-cache hits and a preemption's outputs),
    counting every sampled token, and reset when the slot is reused; min_tokens bans lift after N samples."""
    r = _runner(tiny_tied)
    state = r.sampling
    rng = np.random.default_rng(5)
    plain = dict(slot=0, tokens=rng.integers(0, 500, 9).tolist(), start=0, new_blocks=[0])
    r.execute(make_step([plain]))
    assert state.output_counts is None and state.prompt_mask is None and not state.any_controls  # nothing used

    # slot 3 restarts after a preemption: 20 tokens of prompt (the first 16 hit the prefix cache: start=16),
    # 4 outputs so far; it recomputes from position 16
    prompt, outputs = rng.integers(0, 500, 20).tolist(), [7, 7, 9, 450]
    pen = dict(
        slot=3, tokens=(prompt + outputs)[16:], start=16, new_blocks=[10, 11], frequency_penalty=0.5,
        repetition_penalty=1.3, penalty_prompt=prompt, outputs=outputs,
    )  # fmt: skip
    tok = r.execute(make_step([pen, dict(slot=0, tokens=[1])])).tolist()[:1]
    assert state.output_counts.shape == (8, 512) and state.output_counts.dtype == torch.int32
    expect = np.bincount(outputs + [tok[0]], minlength=512)
    np.testing.assert_array_equal(state.output_counts[3].numpy(), expect)
    np.testing.assert_array_equal(np.flatnonzero(state.prompt_mask[3].numpy()), sorted(set(prompt)))
    assert state.output_counts[0].sum() == 0  # the unpenalized slot is not counted
    for _ in range(3):
        tok += r.execute(make_step([dict(slot=3, tokens=[tok[-1]])])).tolist()
    np.testing.assert_array_equal(state.output_counts[3].numpy(), np.bincount(outputs + tok, minlength=512))

    # the slot is reused by a sequence with min_tokens: counts and mask reset, the ban holds for 2 samples
    greedy_next = r.execute(make_step([dict(slot=0, tokens=[2])])).tolist()[0]
    fresh = dict(slot=3, tokens=plain["tokens"] + [1, 2], start=0, new_blocks=[20], presence_penalty=0.1)
    again = make_step([fresh], freed=[3])
    assert r.execute(again).tolist()[0] == greedy_next  # penalties of an empty history change nothing
    assert state.output_counts[3].sum() == 1 and not state.prompt_mask[3].any()
    ban = dict(
        slot=5, tokens=plain["tokens"] + [1, 2], start=0, new_blocks=[30], min_tokens=2, stop_token_ids=[greedy_next]
    )
    first = r.execute(make_step([ban])).tolist()[0]
    assert first != greedy_next and state.min_tokens_left[5] == 1
    r.execute(make_step([dict(slot=5, tokens=[first])]))
    assert state.min_tokens_left[5] == 0
    r.execute(make_step([dict(slot=3, tokens=[1])], freed=[5]))
    assert state.num_logprobs[5] == -1 and not state.has_penalty[5]


def test_sampling_tensors_copy_only_the_controls_the_chosen_path_reads(tiny_tied):
    state = _runner(tiny_tied).sampling
    slots, positions = np.array([0, 1]), np.array([5, 6])
    state.temperature[:2] = [0.6, 0.0]
    st = state.tensors(slots, positions)  # CPU: the torch sampler reads every control
    assert all(x is not None for x in (st.temperature, st.top_k, st.top_p, st.min_p, st.seed, st.position))
    state.on_cuda = True  # decide as a CUDA worker would (no CUDA op runs in tensors)
    st = state.tensors(slots, positions)  # the fused kernel: the temperature alone
    assert st.temperature.tolist() == pytest.approx([0.6, 0.0])
    assert all(x is None for x in (st.top_k, st.top_p, st.min_p, st.seed, st.position))
    state.top_p[1] = 0.9  # one top-p row takes the batch to the torch sampler, which needs everything
    st = state.tensors(slots, positions)
    assert st.any_top_p and st.top_p.tolist() == pytest.approx([1.0, 0.9]) and st.position.tolist() == [5, 6]
    state.temperature[:2], state.top_p[1] = 0.0, 1.0
    st = state.tensors(slots, positions)  # all greedy: an argmax reads no control
    assert st.all_greedy and st.temperature is None and st.top_k is None
