"""vLLM's allowed_token_ids through ``nanoserve.LLM`` (real worker processes) on a float32 tiny checkpoint: greedy
decoding equals HF transformers' restricted to the same ids (``prefix_allowed_tokens_fn``), sampled tokens never
leave the set, the other requests of a batch equal HF's plain greedy output, and bad values are refused naming the
field (at construction; ids outside the vocabulary at admission, the engine serving on)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams
from protocol.errors import RequestError
from tests.support.oracle import hf_greedy, prompts_with_shared_prefixes

ENGINE = dict(max_model_len=256, num_kv_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def llm(tiny_tied):
    with LLM(str(tiny_tied), **ENGINE) as engine:
        yield engine


def hf_restricted_greedy(model_dir, prompt: list[int], allowed: list[int], n: int) -> list[int]:
    """HF's greedy continuation with every step restricted to ``allowed`` (its own logits processor)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
            prefix_allowed_tokens_fn=lambda batch_id, ids: allowed,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_equals_hf_restricted_and_the_batch_is_left_alone(llm, tiny_tied):
    prompts = prompts_with_shared_prefixes()[:3]
    plain = hf_greedy(tiny_tied, prompts, 8)
    # ids HF's plain greedy output never uses, so the restriction must change the output
    allowed = sorted({5, 17, 42, 99, 300} - set(plain[1]))
    expected = hf_restricted_greedy(tiny_tied, prompts[1], allowed, 8)
    assert expected != plain[1] and set(expected) <= set(allowed)
    params = [greedy(8), greedy(8, allowed_token_ids=allowed), greedy(8)]
    got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert got[1] == expected
    assert [got[0], got[2]] == [plain[0], plain[2]]


def test_sampled_tokens_stay_in_the_allowed_set(llm):
    prompt = prompts_with_shared_prefixes()[0]
    allowed = [3, 64, 200, 301]
    params = SamplingParams(temperature=1.5, seed=7, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed, n=4)
    outs = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = [t for c in outs.outputs for t in c.token_ids]
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1  # sampled, and only among them
    free = llm.generate([prompt], SamplingParams(temperature=1.5, seed=7, max_tokens=24, ignore_eos=True), False)[0]
    assert not set(free.outputs[0].token_ids) <= set(allowed)  # the same request unrestricted leaves the set


def test_bad_allowed_token_ids_are_refused_naming_the_field(llm):
    for bad in ([], [-1], [1.5], "5", [True]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(RequestError, match="allowed_token_ids token ids must be below the vocabulary size"):
        llm.generate([[1, 2, 3]], greedy(2, allowed_token_ids=[4, 10**6]), use_tqdm=False)
    # the engine serves on
    assert llm.generate([[1, 2, 3]], greedy(2, allowed_token_ids=[4]), use_tqdm=False)[0].outputs[0].token_ids == [4, 4]
