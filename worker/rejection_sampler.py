"""Speculative decoding's acceptance, batched over every position of a step's verify rows in a few torch ops.

A verify row scores 1 + d positions: position j < d holds the target's logits where draft j was proposed, the last
one (no draft) only ever yields the bonus token. Each position's distribution is the normal sampler's (the same
controls, then temperature / top-k / top-p / min-p), so the emitted tokens follow the target exactly:

- greedy rows (temperature 0): draft j is accepted iff it is the argmax of the processed logits; the token after
  the accepted run is that argmax (the correction, or the bonus when every draft matched);
- sampled rows: the drafts are deterministic (n-gram: q is one-hot), so draft j is accepted with probability
  p_j(draft_j); at the first rejection the token is drawn from the residual (p_j without the draft, renormalized),
  and when all are accepted the bonus is drawn from p_d. For every j, P(token j = x) = p_j(x).

Draws use the normal sampler's exponential race (argmax of p / E); a residual needs no renormalizing there. A
seeded row takes its noise from the seed and the position (worker/sampler.py ``seeded_uniform``), the acceptance
uniforms from a salted seed, so a seeded request's tokens are a pure function of its seed, prompt and drafts.
"""

from __future__ import annotations

import torch

from worker.sampler import SamplingTensors, apply_controls, apply_filters, seeded_uniform

_ACCEPT_SALT = 0x5DEECE66D  # the acceptance uniforms of a seeded row: a stream apart from its token noise


def residual(probs: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Each position's distribution with its draft's mass removed (unnormalized); positions without a draft
    (-1: the bonus) keep theirs."""
    zeroed = probs.scatter(1, drafts.clamp(min=0)[:, None], 0.0)
    return torch.where((drafts >= 0)[:, None], zeroed, probs)


def _uniforms(st: SamplingTensors, n: int, vocab: int, generator: torch.Generator | None, device) -> tuple:
    """(acceptance uniforms [n], race noise [n, vocab]); seeded rows draw both from their seed and position."""
    accept_u = torch.rand(n, device=device, generator=generator)
    noise = torch.rand((n, vocab), device=device, generator=generator)
    if st.any_seed:
        seeded = st.seed >= 0
        noise = torch.where(seeded[:, None], seeded_uniform(st.seed, st.position, vocab), noise)
        salted = seeded_uniform(st.seed ^ _ACCEPT_SALT, st.position, 1)[:, 0]
        accept_u = torch.where(seeded, salted, accept_u)
    return accept_u, noise


def verify(
    logits: torch.Tensor,
    st: SamplingTensors,
    drafts: torch.Tensor,
    owner: torch.Tensor,
    offset: torch.Tensor,
    grid_shape: tuple[int, int],
    generator: torch.Generator | None = None,
    accept_all: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject the drafts of every verify row at once.

    ``logits`` [P, vocab]: every position of every verify row; ``st``: the controls of each position (as the
    normal sampler's per row); ``drafts`` int64 [P]: the draft scored at each position, -1 at a row's last one;
    ``owner``/``offset`` int64 [P]: each position's verify row and its index j in that row; ``grid_shape``:
    (verify rows, 1 + the largest d), from the host; ``accept_all``: benchmark only (NANOSERVE_BENCH_ACCEPT_DRAFTS),
    every draft is kept.

    Returns (tokens [P], num_accepted [verify rows]): at position j of row r, the token emitted there if j <= a_r
    (draft j for j < a_r, the target's own token at j = a_r); later positions hold the target's would-be token."""
    processed = apply_controls(logits.float(), st)
    target = processed.argmax(-1)  # greedy rows
    has_draft = drafts >= 0
    if st.all_greedy:
        accept = has_draft & (drafts == target)
        own = target
    else:
        probs = apply_filters(processed, st).softmax(-1)
        accept_u, noise = _uniforms(st, len(drafts), probs.shape[1], generator, probs.device)
        p_draft = probs.gather(1, drafts.clamp(min=0)[:, None])[:, 0]
        rest = residual(probs, drafts)
        # a draft holding all the mass is kept: its residual is empty (rounding can leave p_draft just below 1)
        sampled_accept = (accept_u < p_draft) | (rest.sum(-1) <= 0)
        sampled_own = (rest / -noise.clamp_(min=1e-20).log()).argmax(-1)
        greedy = st.temperature == 0
        accept = has_draft & torch.where(greedy, drafts == target, sampled_accept)
        own = torch.where(greedy, target, sampled_own)
    if accept_all:
        accept = has_draft
    # [rows, 1 + max d]: padding stays False, so the leading run of True is the accepted count
    grid = torch.zeros(grid_shape, dtype=torch.long, device=drafts.device)
    grid[owner, offset] = accept.long()
    num_accepted = grid.cumprod(1).sum(1)
    tokens = torch.where(offset < num_accepted[owner], drafts, own)
    return tokens, num_accepted
