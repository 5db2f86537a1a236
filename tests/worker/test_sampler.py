"""worker/sampler.py: filters never let an excluded token through, temperature sampling has the right
frequencies, greedy rows are argmax, seeded rows are reproducible whatever shares their batch; and the same
through a real ModelRunner on a tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.builders import make_step, vllm_penalized, worker_config
from worker.sampler import SamplingTensors, sample, seeded_uniform

V = 48


def controls(
    n: int,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seed=-1,
    position=0,
) -> SamplingTensors:
    """Per-row controls; each argument is a scalar (broadcast) or a sequence of n values."""

    def col(v, dtype):
        return torch.as_tensor(np.broadcast_to(np.asarray(v), (n,)).copy(), dtype=dtype)

    t, k, p = col(temperature, torch.float32), col(top_k, torch.int64), col(top_p, torch.float32)
    mp, sd, pos = col(min_p, torch.float32), col(seed, torch.int64), col(position, torch.int64)
    return SamplingTensors(
        temperature=t,
        top_k=k,
        top_p=p,
        min_p=mp,
        seed=sd,
        position=pos,
        all_greedy=bool((t == 0).all()),
        any_top_k=bool((k > 0).any()),
        any_top_p=bool((p < 1).any()),
        any_min_p=bool((mp > 0).any()),
        any_seed=bool((sd >= 0).any()),
    )


def base_logits(seed: int = 0, scale: float = 1.5) -> np.ndarray:
    """Distinct logits (no ties), float32."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(V) * scale).astype(np.float32)


def np_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def allowed_set(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens vLLM's semantics allow, computed independently in float64 numpy: temperature, then top-k,
    then top-p over the renormalized top-k distribution (the smallest top set reaching top_p), then min-p
    relative to the most likely token."""
    probs = np_softmax(logits / temperature)
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(V, bool)
    k = top_k if top_k > 0 else V
    keep[order[:k]] = True
    renorm = np.where(keep, probs, 0.0)
    renorm /= renorm.sum()
    mass_before = 0.0
    for tok in order[:k]:
        if mass_before >= top_p:
            keep[tok] = False
        mass_before += renorm[tok]
    keep &= probs >= min_p * probs.max()
    return set(np.flatnonzero(keep).tolist())


def margin_ok(logits: np.ndarray, temperature: float, top_p: float, min_p: float) -> bool:
    """True when no cumulative mass / min-p ratio sits within float32 rounding of a threshold."""
    probs = np_softmax(logits / temperature)
    s = np.sort(probs)[::-1]
    cum = np.cumsum(s) - s
    ok_p = np.min(np.abs(cum - top_p)) > 1e-4 if top_p < 1 else True
    ok_m = np.min(np.abs(s / s[0] - min_p)) > 1e-4 if min_p > 0 else True
    return ok_p and ok_m


def draw(logits: np.ndarray, n: int, gen_seed: int = 0, **kw) -> np.ndarray:
    rows = torch.from_numpy(np.tile(logits, (n, 1)))
    gen = torch.Generator().manual_seed(gen_seed)
    return sample(rows, controls(n, **kw), gen).numpy()


# ---- filters -----------------------------------------------------------------------------------------


FILTER_CASES = [
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.7, top_p=0.6),
    dict(temperature=2.0, top_p=0.3),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=3.0, min_p=0.5),
    dict(temperature=1.3, top_k=12, top_p=0.8, min_p=0.1),
    dict(temperature=0.5, top_k=30, top_p=0.95, min_p=0.02),
    dict(temperature=1.0, top_k=-1, top_p=0.5),  # -1 disables top-k like 0
]


@pytest.mark.parametrize("case", FILTER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_filters_never_emit_excluded_tokens(case):
    logits = base_logits(3)
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | case
    assert margin_ok(logits, full["temperature"], full["top_p"], full["min_p"])
    allowed = allowed_set(logits, full["temperature"], full["top_k"], full["top_p"], full["min_p"])
    assert 0 < len(allowed) < V  # the case really filters something
    got = draw(logits, 6000, **case)
    emitted = set(got.tolist())
    assert emitted <= allowed, f"excluded tokens emitted: {sorted(emitted - allowed)}"
    # nothing allowed is dropped either: every allowed token with a reasonable probability shows up
    probs = np_softmax(logits / full["temperature"])
    kept_mass = sum(probs[t] for t in allowed)
    likely = {t for t in allowed if probs[t] / kept_mass > 3e-3}
    assert likely <= emitted, f"allowed tokens never drawn: {sorted(likely - emitted)}"


def test_filters_per_row_in_one_mixed_batch():
    """Rows with different controls in one batch each respect only their own filter."""
    logits = base_logits(5)
    cases = [
        dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0),
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        dict(temperature=0.8, top_k=0, top_p=0.5, min_p=0.0),
        dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.3),
    ]
    reps = 2000
    n = reps * len(cases)
    col = {k: [c[k] for c in cases] * reps for k in cases[0]}
    rows = torch.from_numpy(np.tile(logits, (n, 1)))
    got = sample(rows, controls(n, **col), torch.Generator().manual_seed(1)).numpy().reshape(reps, len(cases))
    for j, c in enumerate(cases):
        assert margin_ok(logits, c["temperature"], c["top_p"], c["min_p"])
        allowed = allowed_set(logits, **c)
        emitted = set(got[:, j].tolist())
        assert emitted <= allowed, f"row kind {c}: excluded {sorted(emitted - allowed)}"
    assert len(set(got[:, 1].tolist())) > 10  # the unfiltered row really ranges over the vocabulary


def test_seeded_rows_respect_filters():
    """The counter-based noise of seeded rows must exclude filtered tokens just as the generator's does."""
    logits = base_logits(3)
    n = 8000
    got = draw(logits, n, temperature=1.0, top_k=4, seed=np.arange(n), position=7)
    allowed = allowed_set(logits, 1.0, 4, 1.0, 0.0)
    assert set(got.tolist()) == allowed


def test_seeded_uniform_is_strictly_inside_0_1():
    """Noise of exactly 1.0 turns an excluded token's score into 0/-0 = NaN, which wins argmax.
    (seed 227075, position 5, token 230) hashes to the top of the 32-bit range."""
    u = seeded_uniform(torch.tensor([227075, 1, 2]), torch.tensor([5, 5, 5]), 512)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    logits = torch.full((1, 512), -5.0)
    logits[0, 3] = 5.0  # top-k 1 keeps only token 3; token 230 is excluded
    st = controls(1, temperature=1.0, top_k=1, seed=227075, position=5)
    assert int(sample(logits, st)[0]) == 3


# ---- temperature ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_frequencies_match_softmax(temperature):
    logits = base_logits(11, scale=1.0)[:12]
    n = 20000
    rows = torch.from_numpy(np.tile(logits, (n, 1)))
    got = sample(rows, controls(n, temperature=temperature), torch.Generator().manual_seed(2)).numpy()
    freq = np.bincount(got, minlength=len(logits)) / n
    expected = np_softmax(logits / temperature)
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) < 5 * sigma + 1e-3), (freq, expected)
    # the wrong temperature would be caught: compare against T=1 for the non-unit cases
    if temperature != 1.0:
        wrong = np_softmax(logits)
        assert np.max(np.abs(freq - wrong) - 5 * sigma) > 0


def test_seeded_noise_frequencies_match_softmax():
    """Seeded rows (one distinct seed per row) draw from the same distribution as unseeded ones."""
    logits = base_logits(11, scale=1.0)[:12]
    n = 20000
    rows = torch.from_numpy(np.tile(logits, (n, 1)))
    got = sample(rows, controls(n, temperature=0.8, seed=np.arange(n) * 7919 + 1, position=3)).numpy()
    freq = np.bincount(got, minlength=len(logits)) / n
    expected = np_softmax(logits / 0.8)
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) < 5 * sigma + 1e-3), (freq, expected)


# ---- greedy ----------------------------------------------------------------------------------------------


def test_greedy_rows_are_argmax_even_mixed_with_sampled_rows():
    rng = np.random.default_rng(4)
    n = 400
    logits = torch.from_numpy((rng.standard_normal((n, V)) * 2).astype(np.float32))
    temperature = np.where(np.arange(n) % 3 == 0, 0.0, 1.0)
    # greedy rows also carry filters and seeds: none of it may change their argmax
    top_k = np.where(np.arange(n) % 5 == 0, 3, 0)
    seed = np.where(np.arange(n) % 2 == 0, np.arange(n), -1)
    st = controls(n, temperature=temperature, top_k=top_k, top_p=0.9, min_p=0.05, seed=seed, position=9)
    got = sample(logits, st, torch.Generator().manual_seed(0)).numpy()
    argmax = logits.numpy().argmax(-1)
    greedy = temperature == 0
    np.testing.assert_array_equal(got[greedy], argmax[greedy])
    assert (got[~greedy] != argmax[~greedy]).sum() > 20  # sampled rows really sample
    # all-greedy batch (the fast path)
    st = controls(n, temperature=0.0)
    np.testing.assert_array_equal(sample(logits, st).numpy(), argmax)


# ---- seeds -----------------------------------------------------------------------------------------------


def test_seeded_rows_reproduce_whatever_shares_the_batch():
    rng = np.random.default_rng(8)
    flat = torch.from_numpy((rng.standard_normal(512) * 0.3).astype(np.float32))  # near-uniform: seeds decide
    m = 64
    seeds = np.arange(m) * 1000 + 17
    positions = np.arange(m) + 5

    def run(order: np.ndarray, n_unseeded: int, gen_seed: int, other_seeds: int = 0) -> np.ndarray:
        """Our m seeded rows (in ``order``) interleaved with unseeded and other seeded neighbours."""
        kinds = (
            [("ours", int(i)) for i in order] + [("free", 0)] * n_unseeded + [("other", j) for j in range(other_seeds)]
        )
        perm = np.random.default_rng(gen_seed).permutation(len(kinds))
        kinds = [kinds[i] for i in perm]
        seed_col = [seeds[i] if k == "ours" else (10**9 + i if k == "other" else -1) for k, i in kinds]
        pos_col = [positions[i] if k == "ours" else 3 for k, i in kinds]
        temp_col = [1.0 if k == "ours" else [0.0, 0.7, 1.9][j % 3] for j, (k, _) in enumerate(kinds)]
        rows = flat.repeat(len(kinds), 1)
        st = controls(len(kinds), temperature=temp_col, seed=seed_col, position=pos_col, top_p=0.99)
        got = sample(rows, st, torch.Generator().manual_seed(gen_seed)).numpy()
        out = np.empty(m, np.int64)
        for (k, i), tok in zip(kinds, got):
            if k == "ours":
                out[i] = tok
        return out

    alone = run(np.arange(m), 0, 0)
    assert np.array_equal(alone, run(np.arange(m)[::-1], 0, 1))
    assert np.array_equal(alone, run(np.arange(m), 100, 2))
    assert np.array_equal(alone, run(np.random.default_rng(3).permutation(m), 37, 3, other_seeds=20))
    # our rows only: one at a time
    for i in (0, 13, 63):
        st = controls(1, temperature=1.0, seed=seeds[i], position=positions[i], top_p=0.99)
        assert int(sample(flat[None], st)[0]) == alone[i]
    # different seeds / positions give different tokens (512-way near-uniform: collisions are rare)
    assert len(set(alone.tolist())) > m * 0.8
    shifted = sample(flat.repeat(m, 1), controls(m, seed=seeds, position=positions + 1, top_p=0.99)).numpy()
    assert (shifted != alone).sum() > m * 0.8
    reseeded = sample(flat.repeat(m, 1), controls(m, seed=seeds + 1, position=positions, top_p=0.99)).numpy()
    assert (reseeded != alone).sum() > m * 0.8


def test_seeds_differing_only_in_high_bits_differ():
    """SamplingParams accepts seeds up to 2**63: seeds equal in their low 32 bits must still differ."""
    flat = torch.zeros(1, 512)
    m = 64
    lo = np.arange(m) + 5
    a = sample(flat.repeat(m, 1), controls(m, seed=lo, position=4)).numpy()
    b = sample(flat.repeat(m, 1), controls(m, seed=lo + 2**32, position=4)).numpy()
    c = sample(flat.repeat(m, 1), controls(m, seed=lo + 2**62, position=4)).numpy()
    assert (a != b).sum() > m * 0.8
    assert (a != c).sum() > m * 0.8


def test_unseeded_rows_vary_across_calls():
    flat = torch.zeros(256, 512)
    st = controls(256, temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    first, second = sample(flat, st, gen).numpy(), sample(flat, st, gen).numpy()
    assert (first != second).sum() > 200
    # and without an explicit generator (the global one)
    assert (sample(flat, st).numpy() != sample(flat, st).numpy()).sum() > 200


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
