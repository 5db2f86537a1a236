"""End to end through real worker processes: greedy tokens equal HF transformers' on float32 checkpoints,
with a roomy engine and with one so tight that chunked prefill, preemption and prefix-cache hits all happen."""

import pytest

from nanoserve import LLM, SamplingParams
from tests.support.oracle import hf_greedy, prompts_with_shared_prefixes

MAX_TOKENS = 24


@pytest.mark.parametrize(
    "fixture,async_scheduling,async_depth",
    [("tiny_tied", True, 2), ("tiny_untied", True, 2), ("tiny_tied", False, 1), ("tiny_tied", True, 1)],
)
def test_greedy_parity_roomy_and_tight(fixture, async_scheduling, async_depth, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = prompts_with_shared_prefixes()
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    engine = dict(async_scheduling=async_scheduling, async_depth=async_depth)
    with LLM(str(model_dir), max_model_len=256, num_kv_blocks=256, block_size=16, **engine) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [c.token_ids for c in got] == expected
        assert [c.prompt_token_ids for c in got] == prompts
        assert all(c.finish_reason == "length" for c in got)
        # a second round hits the prefix cache for every prompt longer than a block
        again = llm.generate(prompts, params, use_tqdm=False)
        assert [c.token_ids for c in again] == expected
        stats = llm.stats()
        assert stats["prefix_cache_hit_tokens"] > 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]

    # 14 blocks of 8 tokens = 112 token slots for 12 requests of up to 130 tokens; 32-token step budget
    tight = dict(max_model_len=160, num_kv_blocks=18, block_size=8, max_num_batched_tokens=32, **engine)
    with LLM(str(model_dir), **tight) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [c.token_ids for c in got] == expected
        stats = llm.stats()
        assert stats["preemptions"] > 0
        assert stats["chunked_prefill_steps"] > 0
        assert stats["prefix_cache_hit_tokens"] > 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
