"""logit_bias and prompt_logprobs on CUDA (Triton kernels, CUDA graphs when not eager, the fused sampling kernel,
pinned host copies of the prompt logprobs) against HF transformers on a float32 tiny checkpoint."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.engine.test_sampling_extras import N, biased_greedy, check_prompt_logprobs, hf  # noqa: F401 (fixture)
from tests.support.builders import GPU_ENGINE
from tests.support.oracle import hf_greedy, prompts_with_shared_prefixes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_logit_bias_and_prompt_logprobs_on_cuda(tiny_tied, hf, enforce_eager):  # noqa: F811
    prompts = prompts_with_shared_prefixes()
    biases = []
    for i, prompt in enumerate(prompts):  # every other request: its first token flipped to the second best
        (v1, v2), (_, second) = (t.tolist() for t in hf(prompt)[-1].topk(2))
        biases.append({second: v1 - v2 + 0.5, 11: -3.0} if i % 2 else None)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=b) for b in biases]
    for i in range(0, len(prompts), 3):
        params[i].prompt_logprobs = N
    chosen = int(hf(prompts[0])[-1].argmin())
    # sampled rows (the fused kernel's path): +100 makes the least likely token certain
    sampled = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, logit_bias={chosen: 100.0})
    kw = dict(**GPU_ENGINE, max_model_len=256, enforce_eager=enforce_eager, max_num_seqs=16, max_num_batched_tokens=64)
    with LLM(str(tiny_tied), **kw) as llm:  # 64-token steps: the longer prompts arrive in chunks
        got = llm.generate(prompts + [prompts[0]], params + [sampled], use_tqdm=False)
        assert llm.stats()["chunked_prefill_steps"] > 0
    expected = hf_greedy(tiny_tied, prompts, 8)
    for prompt, p, out, plain in zip(prompts, params, got, expected):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(hf, prompt, out.prompt_logprobs, tol=1e-2)  # tf32 attention dots on CUDA
        if p.logit_bias is None:
            assert out.token_ids == plain
        else:
            assert out.token_ids == biased_greedy(hf, prompt, p.logit_bias, 8)
    assert got[-1].token_ids == [chosen] * 8
