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
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams
from tests.support.controls import MAX_TOKENS, check_completion, params_for
from tests.support.oracle import prompts_with_shared_prefixes

ROOMY = dict(max_model_len=256, num_kv_blocks=256, block_size=16)
TIGHT = dict(max_model_len=160, num_kv_blocks=18, block_size=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def hf(tiny_tied):
    model = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32).eval()

    def logits(prompt: list[int], output: list[int]) -> np.ndarray:
        """Raw float64 logits predicting each output token, teacher-forced on prompt + output."""
        with torch.no_grad():
            out = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
        return out.double().numpy()

    return logits


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
    kwargs = dict(
        ROOMY if engine == "roomy" else TIGHT, async_scheduling=async_scheduling, tensor_parallel_size=tp, device="cpu"
    )
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
                assert [e.rank for e in da.values()] == [e.rank for e in db.values()]
                np.testing.assert_allclose(
                    [e.logprob for e in da.values()], [e.logprob for e in db.values()], atol=1e-5
                )
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
