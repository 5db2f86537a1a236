"""logit_bias and prompt_logprobs end to end through ``client.LLM`` (real worker processes) on a float32 tiny
checkpoint, against HF transformers: a bias steers greedy decoding exactly as vLLM's (added to the raw logits)
while the logprobs stay the raw distribution's, and leaves the other requests of its batch alone; prompt logprobs
equal HF's teacher-forced log-softmax with the right ranks, in a roomy engine, with prompts in the prefix cache,
and in a tight one where chunked prefill and preemption happen."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams
from tests.support.oracle import hf_greedy, prompts_with_shared_prefixes

ROOMY = dict(max_model_len=256, num_kv_blocks=256, block_size=16)
TIGHT = dict(max_model_len=160, num_kv_blocks=18, block_size=8, max_num_batched_tokens=32)
N = 4  # prompt_logprobs


@pytest.fixture(scope="module")
def hf(tiny_tied):
    model = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32).eval()

    @functools.cache
    def cached(ids: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float64 log-softmax of the teacher-forced logits: row q predicts ids[q + 1]."""
        return cached(tuple(ids))

    return log_softmax


@pytest.fixture(scope="module")
def roomy(tiny_tied):
    with LLM(str(tiny_tied), **ROOMY) as llm:
        yield llm


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- logit_bias -------------------------------------------------------------------------------------------


def test_logit_bias_steers_greedy_and_leaves_the_batch_alone(roomy, hf, tiny_tied):
    prompts = prompts_with_shared_prefixes()[:4]
    plain = hf_greedy(tiny_tied, prompts, 6)
    lp = hf(prompts[0])[-1]  # the distribution of the first output token of prompts[0]
    best, second = lp.topk(2).indices.tolist()
    chosen = int(lp.argmin())  # the least likely token: only the bias can make it win
    # a large positive bias on one token makes greedy emit it every time
    out = roomy.generate(prompts[0], greedy(6, logit_bias={chosen: 100.0}), use_tqdm=False)[0]
    assert out.token_ids == [chosen] * 6
    # -100 on HF's greedy token: the first token is HF's second best (the bias stays on for every token, so the
    # continuation is greedy with that token excluded, and never emits it)
    out = roomy.generate(prompts[0], greedy(6, logit_bias={best: -100.0}, logprobs=1), use_tqdm=False)[0]
    assert out.token_ids[0] == second != plain[0][0] and best not in out.token_ids
    # logprobs stay vLLM's raw ones: the model's distribution before the bias
    assert out.logprobs[0][second].logprob == pytest.approx(lp[second].item(), abs=1e-4)
    assert out.logprobs[0][best].logprob == pytest.approx(lp[best].item(), abs=1e-4)  # still the top one
    # one biased request in a mixed batch: the others equal HF's greedy output
    params = [greedy(6), greedy(6, logit_bias={chosen: 100.0, 7: -5.0}), greedy(6), greedy(6)]
    got = roomy.generate(prompts, params, use_tqdm=False)
    assert got[1].token_ids == [chosen] * 6
    assert [got[i].token_ids for i in (0, 2, 3)] == [plain[i] for i in (0, 2, 3)]


def test_a_bias_within_the_margin_changes_nothing_and_one_beyond_flips(roomy, hf):
    """The bias is added to the raw logit: log-softmax differences are logit differences, so a bias just under
    the top-2 margin keeps the greedy token and one just over it flips to the second."""
    prompt = prompts_with_shared_prefixes()[2]
    lp = hf(prompt)[-1]
    (v1, v2), (best, second) = lp.topk(2).values.tolist(), lp.topk(2).indices.tolist()
    margin = v1 - v2
    assert margin > 0.01  # the test needs a clear margin
    under = roomy.generate(prompt, greedy(1, logit_bias={second: margin - 0.005}), use_tqdm=False)[0]
    over = roomy.generate(prompt, greedy(1, logit_bias={second: margin + 0.005}), use_tqdm=False)[0]
    assert (under.token_ids, over.token_ids) == ([best], [second])


# ---- prompt_logprobs --------------------------------------------------------------------------------------


def check_prompt_logprobs(hf, prompt: list[int], pl, n: int = N, tol: float = 1e-4) -> None:
    """vLLM's shape: None, then per prompt token {id: Logprob}: the prompt token first (its rank: the tokens at
    least as likely), then the top n ranked 1..n (the prompt token not repeated), each with its own text. Ranks
    are checked up to the tokens within ``tol`` of each other (near-ties may order either way)."""
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    lp = hf(prompt)
    for p in range(1, len(prompt)):
        dist, token, entry = lp[p - 1], prompt[p], pl[p]
        items = list(entry.items())
        assert items[0][0] == token and len(entry) in (n, n + 1) and len(entry) >= 1
        for t, e in items:
            assert e.logprob == pytest.approx(dist[t].item(), abs=tol) and isinstance(e.decoded_token, str)
        v = dist[token].item()
        assert int((dist > v + tol).sum()) + 1 <= items[0][1].rank <= int((dist >= v - tol).sum())
        top = items[1:] if len(entry) == n + 1 else items  # n + 1 entries: the prompt token is outside the top n
        by_rank = sorted(top, key=lambda kv: kv[1].rank)
        assert [e.rank for _, e in by_rank] == list(range(1, n + 1))
        np.testing.assert_allclose([e.logprob for _, e in by_rank], dist.topk(n).values.numpy(), atol=tol)


def test_prompt_logprobs_equal_hf_and_only_askers_get_them(roomy, hf):
    prompts = prompts_with_shared_prefixes()
    asks = [i % 3 != 1 for i in range(len(prompts))]
    params = [greedy(4, prompt_logprobs=N if a else None) for a in asks]
    params[0] = greedy(4, prompt_logprobs=0)
    for _ in range(2):  # the second time every prompt longer than a block is in the prefix cache
        got = roomy.generate(prompts, params, use_tqdm=False)
        for prompt, p, out in zip(prompts, params, got):
            if p.prompt_logprobs is None:
                assert out.prompt_logprobs is None
            else:
                check_prompt_logprobs(hf, prompt, out.prompt_logprobs, p.prompt_logprobs)
    assert roomy.stats()["prefix_cache_hit_tokens"] > 0
    # a one-token prompt has nothing to predict
    assert roomy.generate([7], greedy(2, prompt_logprobs=3), use_tqdm=False)[0].prompt_logprobs == [None]


def biased_greedy(hf, prompt: list[int], bias: dict[int, float], n: int) -> list[int]:
    """HF's greedy continuation with ``bias`` added to the logits (log-softmax differs by a constant per row)."""
    out: list[int] = []
    for _ in range(n):
        scores = hf(prompt + out)[-1].clone()  # cached: a copy to add to
        for t, b in bias.items():
            scores[t] += b
        out.append(int(scores.argmax()))
    return out


@pytest.mark.parametrize("async_scheduling, tp", [(True, 1), (False, 1), (True, 2)])
def test_prompt_logprobs_and_bias_with_chunked_prefill_and_preemption(tiny_tied, hf, async_scheduling, tp):
    """tp=2: every rank runs the LM head on the prompt rows (a collective), rank 0 computes the logprobs; a
    biased batch is sampled on rank 0, not on the vocabulary shards."""
    prompts = prompts_with_shared_prefixes()
    biases: list[dict[int, float] | None] = []
    for i, prompt in enumerate(prompts):  # every other request: its first token flipped to the second best
        (v1, v2), (_, second) = (t.tolist() for t in hf(prompt)[-1].topk(2))
        biases.append({second: v1 - v2 + 0.5, 11: -3.0} if i % 2 else None)
    params = [greedy(8, prompt_logprobs=N, logit_bias=b) for b in biases]
    with LLM(str(tiny_tied), **TIGHT, async_scheduling=async_scheduling, tensor_parallel_size=tp, device="cpu") as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert stats["chunked_prefill_steps"] > 0 and stats["preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    expected = hf_greedy(tiny_tied, prompts, 8)
    for prompt, bias, out, plain in zip(prompts, biases, got, expected):
        check_prompt_logprobs(hf, prompt, out.prompt_logprobs)
        if bias is None:
            assert out.token_ids == plain
        else:
            assert out.token_ids == biased_greedy(hf, prompt, bias, 8) and out.token_ids[0] != plain[0]
