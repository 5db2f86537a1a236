"""The rejection sampler of speculative decoding (worker/rejection_sampler.py) keeps the target distribution.

Many identical verify rows (2 drafts each) over fixed target logits, in one batched call: the token emitted at
each position must follow the target's processed distribution there (temperature, top-k, top-p), position 0 over
every row, position j > 0 over the rows that accepted the j drafts before it. A chi-square test with a fixed seed
decides (deterministic); the same test rejects a sampler with a wrong residual (the draft's mass left in)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.controls import controls
from worker import rejection_sampler
from worker.rejection_sampler import verify

V = 12
ROWS = 6000  # verify rows per case: position 0 sees 6000 draws, position 1 ~6000 * p0(draft 0)
D = 2


def target_logits() -> np.ndarray:
    rng = np.random.default_rng(7)
    return (rng.standard_normal((D + 1, V)) * 1.3).astype(np.float32)


def target_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution at one position, in float64 numpy: temperature, top-k, then top-p over the
    renormalized top-k (the smallest top set reaching top_p)."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(V, bool)
    keep[order[: top_k if top_k > 0 else V]] = True
    q = np.where(keep, p, 0.0) / p[keep].sum()
    before = np.cumsum(q[order]) - q[order]
    keep[order[before >= top_p]] = False
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs``; a count where the target has no mass fails."""
    support = probs > 0
    if counts[~support].sum():
        return 0.0
    n = counts.sum()
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def run(temperature: float, top_k: int, top_p: float, seeded: bool) -> tuple[list[float], np.ndarray]:
    logits = target_logits()
    probs = [target_probs(row, temperature, top_k, top_p) for row in logits]
    # drafts of middling probability, so that acceptance, the residual and the bonus all happen often
    drafts = [int(np.argsort(-p)[1]) for p in probs[:D]]
    positions = np.tile(np.arange(D + 1), ROWS)
    seed = np.repeat(np.arange(ROWS), D + 1) if seeded else -1
    st = controls(ROWS * (D + 1), temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, position=positions + 40)
    tokens, accepted = verify(
        torch.from_numpy(np.tile(logits, (ROWS, 1))),
        st,
        torch.tensor(np.tile([*drafts, -1], ROWS), dtype=torch.int64),
        torch.from_numpy(np.repeat(np.arange(ROWS), D + 1)),
        torch.from_numpy(positions),
        (ROWS, D + 1),
        torch.Generator().manual_seed(1234),
    )
    grid, accepted = tokens.numpy().reshape(ROWS, D + 1), accepted.numpy()
    pvalues = []
    for j in range(D + 1):
        reached = accepted >= j  # the rows whose position j emitted a token
        counts = np.bincount(grid[reached, j], minlength=V)
        pvalues.append(chi2_pvalue(counts, probs[j]))
    return pvalues, accepted


CASES = {"temperature": (0.8, 0, 1.0), "top_k": (1.0, 5, 1.0), "top_p": (1.1, 0, 0.8)}


@pytest.mark.parametrize("seeded", [False, True], ids=["generator", "seeded"])
@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target_distribution(case, seeded):
    pvalues, accepted = run(*CASES[case], seeded=seeded)
    assert min(pvalues) > 1e-3, pvalues
    assert set(np.unique(accepted)) == {0, 1, 2}  # rejection, partial acceptance and the bonus all happened


def test_a_wrong_residual_is_caught(monkeypatch):
    """The test's power: resampling from the whole target distribution after a rejection (the draft's mass left
    in) over-produces the draft, and the chi-square says so."""
    monkeypatch.setattr(rejection_sampler, "residual", lambda probs, drafts: probs)
    pvalues, _ = run(*CASES["temperature"], seeded=False)
    assert pvalues[0] < 1e-9, pvalues


def test_greedy_accepts_exact_matches_only_and_adds_the_bonus():
    logits = torch.from_numpy(target_logits())
    best = logits.argmax(-1)
    other = (best + 1) % V
    # three rows over the same positions: all accepted (+ bonus), the first rejected, the second rejected
    drafts = torch.stack([best[:2], torch.stack([other[0], best[1]]), torch.stack([best[0], other[1]])])
    flat = torch.cat([torch.cat([d, torch.tensor([-1])]) for d in drafts])
    tokens, accepted = verify(
        logits.repeat(3, 1),
        controls(9, temperature=0.0),
        flat,
        torch.arange(3).repeat_interleave(3),
        torch.arange(3).repeat(3),
        (3, 3),
    )
    assert accepted.tolist() == [2, 0, 1]
    grid = tokens.reshape(3, 3)
    assert grid[0].tolist() == best.tolist()  # both drafts, then the bonus argmax
    assert grid[1, 0] == best[0]  # the correction at the first mismatch
    assert grid[2, :2].tolist() == best[:2].tolist()
