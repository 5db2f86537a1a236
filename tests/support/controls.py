"""Sampling controls for tests: ``controls``, per-row SamplingTensors for the sampler's unit tests; and the cases
(penalties, logprobs) with their check against HF's logits, shared by the CPU and the CUDA end-to-end tests."""

from __future__ import annotations

import numpy as np
import torch

from protocol.outputs import Logprob
from protocol.sampling_params import SamplingParams
from tests.support.builders import vllm_penalized
from worker.sampler import SamplingTensors


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


MAX_TOKENS = 24
CASES = [  # cycled over the prompts, so one batch mixes all of them
    dict(),
    dict(repetition_penalty=1.5),
    dict(frequency_penalty=0.8),
    dict(presence_penalty=1.5, repetition_penalty=0.8),
    dict(presence_penalty=-0.5, frequency_penalty=0.5, repetition_penalty=1.2, logprobs=3),
    dict(logprobs=5),
    dict(repetition_penalty=10.0, logprobs=0),
]


def params_for(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **CASES[i % len(CASES)])


def check_completion(hf, prompt: list[int], params: SamplingParams, comp, tol: float = 1e-4) -> None:
    """``tol``: 1e-4 on the CPU; float32 on CUDA computes attention dots in tf32 (~1e-3)."""
    out = comp.token_ids
    assert len(out) == MAX_TOKENS and comp.prompt_token_ids == prompt
    logits = hf(prompt, out)
    for t, tok in enumerate(out):
        pen = vllm_penalized(
            logits[t], prompt, out[:t], params.presence_penalty, params.frequency_penalty, params.repetition_penalty
        )
        assert pen[tok] >= pen.max() - tol, f"token {t}: {tok} is not the argmax of the penalized logits"
    if params.logprobs is None:
        assert comp.logprobs is None
        return
    n = params.logprobs
    assert len(comp.logprobs) == len(out)
    raw = torch.from_numpy(logits).log_softmax(-1).numpy()
    for t, (tok, entry) in enumerate(zip(out, comp.logprobs)):
        # vLLM's layout: the sampled token first, then the top N in descending order (the sampled token is not
        # repeated when it is among them: N or N + 1 entries); the offline API's values are vLLM's Logprobs
        d = {tid: getattr(v, "logprob", v) for tid, v in entry.items()}
        if any(isinstance(v, Logprob) for v in entry.values()):  # ranks 1..N by logprob; None outside the top N
            by_rank = sorted(d, key=lambda tid: -d[tid])
            want = {tid: i + 1 for i, tid in enumerate(by_rank[:n])}
            assert {tid: v.rank for tid, v in entry.items()} == {tid: want.get(tid) for tid in entry}
        items = list(d.items())
        assert items[0][0] == tok and abs(items[0][1] - raw[t, tok]) < tol  # the sampled token's logprob
        assert max(1, n) <= len(d) <= n + 1
        rest = [v for _, v in items[1:]]
        assert rest == sorted(rest, reverse=True)
        top = sorted(items, key=lambda kv: -kv[1])[:n]
        np.testing.assert_allclose([v for _, v in top], np.sort(raw[t])[::-1][:n], atol=tol)
        for tid, v in items:
            assert abs(v - raw[t, tid]) < tol
        if n and len(d) == n + 1:  # the sampled token is outside the top N
            assert raw[t, tok] <= top[-1][1] + tol
