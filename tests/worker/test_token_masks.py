"""Structured outputs on the worker: the sampler reads a step's token bitmasks as xgrammar writes them (xgrammar's
own ``apply_token_bitmask_inplace`` is the oracle), masks only the rows they name, after the other controls, and
greedy and sampled rows then draw only allowed tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.sampler import SamplingTensors, allowed_tokens, apply_controls, sample

xgr = pytest.importorskip("xgrammar")  # a core dependency; absent from bare GPU images

VOCAB = 509  # not a multiple of 32: the last word's high bits lie past the vocabulary


def _tensors(n: int, temperature: float, **kw) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=None,
        top_p=None,
        min_p=None,
        seed=None,
        position=None,
        all_greedy=temperature == 0,
        any_top_k=False,
        any_top_p=False,
        any_min_p=False,
        any_seed=False,
        **kw,
    )


def test_bitmasks_mask_as_xgrammar_does_and_only_their_rows():
    rng = np.random.default_rng(0)
    masks = torch.from_numpy(rng.integers(-(2**31), 2**31, (2, -(-VOCAB // 32)), dtype=np.int64).astype(np.int32))
    logits = torch.from_numpy(rng.standard_normal((3, VOCAB)).astype(np.float32))
    expected = logits[[0, 2]].clone()
    xgr.apply_token_bitmask_inplace(expected, masks)
    out = apply_controls(logits, _tensors(3, 0.0, allowed=(torch.tensor([0, 2]), masks)))
    assert torch.equal(out[[0, 2]], expected) and torch.equal(out[1], logits[1])
    assert torch.equal(allowed_tokens(masks, VOCAB), expected.isfinite())
    biased = (torch.tensor([0]), torch.tensor([int(expected[0].isinf().nonzero()[0])]), torch.tensor([1e4]))
    out = apply_controls(logits, _tensors(3, 0.0, allowed=(torch.tensor([0, 2]), masks), logit_bias=biased))
    assert torch.equal(out[[0, 2]].isfinite(), expected.isfinite())  # a bias does not lift a masked token


def test_greedy_and_sampled_rows_draw_only_allowed_tokens():
    allowed = [3, 77, 508]
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    mask.zero_()
    for t in allowed:
        mask[0, t // 32] |= 1 << (t % 32)
    logits = torch.randn(64, VOCAB)
    rows = torch.arange(64)
    masks = mask.expand(64, -1).contiguous()
    greedy = sample(logits, _tensors(64, 0.0, allowed=(rows, masks)))
    assert torch.equal(greedy, logits[:, allowed].argmax(-1).apply_(lambda i: allowed[i]))
    drawn = sample(logits, _tensors(64, 2.0, allowed=(rows, masks)), torch.Generator().manual_seed(1))
    assert set(drawn.tolist()) <= set(allowed) and len(set(drawn.tolist())) > 1
