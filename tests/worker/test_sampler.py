"""worker/sampler.py: filters never let an excluded token through, temperature sampling has the right
frequencies, greedy rows are argmax, seeded rows are reproducible whatever shares their batch. Penalties, min_tokens
bans and the same through a real ModelRunner: test_sampler_penalties.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.controls import controls
from worker.sampler import sample, seeded_uniform

V = 48


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
