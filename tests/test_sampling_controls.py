"""Penalties and logprobs end to end through ``client.LLM`` (real worker processes) on float32 tiny checkpoints,
checked against HF transformers' logits: every greedy token is the argmax of vLLM's penalized logits given the
prompt and the tokens before it, and every logprob is HF's raw log-softmax (vLLM's default: before penalties
and temperature). Run in a roomy engine, then a tight one where chunked prefill, preemption (penalty state
rebuilt from the tokens sent) and prefix-cache hits (the prompt mask filled from the prompt sent, not computed)
all happen, with sync and async scheduling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import vllm_penalized
from test_e2e_parity import prompts_with_shared_prefixes
from transformers import AutoModelForCausalLM

from client import LLM, SamplingParams

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
ROOMY = dict(max_model_len=256, num_kv_blocks=256, block_size=16)
TIGHT = dict(max_model_len=160, num_kv_blocks=18, block_size=8, max_num_batched_tokens=32)


def params_for(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **CASES[i % len(CASES)])


@pytest.fixture(scope="module")
def hf(tiny_tied):
    model = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32).eval()

    def logits(prompt: list[int], output: list[int]) -> np.ndarray:
        """Raw float64 logits predicting each output token, teacher-forced on prompt + output."""
        with torch.no_grad():
            out = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
        return out.double().numpy()

    return logits


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
    for t, (tok, d) in enumerate(zip(out, comp.logprobs)):
        # vLLM's layout: the sampled token first, then the top N in descending order (the sampled token is not
        # repeated when it is among them: N or N + 1 entries)
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


def repeats(prompt: list[int], out: list[int]) -> int:
    seen, n = set(prompt), 0
    for tok in out:
        n += tok in seen
        seen.add(tok)
    return n


@pytest.mark.parametrize(
    "engine, async_scheduling, tp", [("roomy", True, 1), ("tight", True, 1), ("tight", False, 1), ("tight", True, 2)]
)
def test_penalties_and_logprobs_match_hf(tiny_tied, hf, engine, async_scheduling, tp):
    """tp=2: only rank 0 holds logits, so only it keeps penalty state and computes logprobs."""
    prompts = prompts_with_shared_prefixes()
    params = [params_for(i) for i in range(len(prompts))]
    kwargs = dict(ROOMY if engine == "roomy" else TIGHT, async_scheduling=async_scheduling, tensor_parallel_size=tp)
    with LLM(str(tiny_tied), **kwargs) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        for prompt, p, comp in zip(prompts, params, got):
            check_completion(hf, prompt, p, comp)
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        if engine == "tight":
            assert stats["preemptions"] > 0 and stats["chunked_prefill_steps"] > 0
            assert stats["prefix_cache_hit_tokens"] > 0
            return
        # again: every prompt longer than a block now hits the prefix cache, so the repetition penalty's
        # prompt mask comes from the prompt sent in the new record; results are identical
        again = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
        assert [c.token_ids for c in again] == [c.token_ids for c in got]
        for a, b in zip(again, got):
            assert (a.logprobs is None) == (b.logprobs is None)
            for da, db in zip(a.logprobs or [], b.logprobs or []):
                assert list(da) == list(db)
                np.testing.assert_allclose(list(da.values()), list(db.values()), atol=1e-5)
        # the penalties really act: greedy output without them differs, and a large repetition penalty never
        # repeats a prompt or output token on this model
        plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), False)
        for i, (prompt, p, comp) in enumerate(zip(prompts, params, got)):
            if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1:
                assert comp.token_ids != plain[i].token_ids, p
            else:
                assert comp.token_ids == plain[i].token_ids
            if p.repetition_penalty == 10:
                assert repeats(prompt, comp.token_ids) == 0 < repeats(prompt, plain[i].token_ids)
