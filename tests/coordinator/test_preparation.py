"""coordinator/admission.py, the one owner of a request's preparation (truncation, the room an unset max_tokens
takes, the model's generation defaults), and Sequence.token_stop, the one token-level stop check. The tiny
model's real tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from coordinator.admission import Admission
from coordinator.block_manager import BlockManager
from coordinator.sequence import Sequence
from protocol.errors import RequestError
from protocol.sampling_params import SamplingParams

MAX_LEN = 256


@pytest.fixture(scope="module")
def tokenizer(tiny_tied):
    return AutoTokenizer.from_pretrained(tiny_tied)


def _admission(tokenizer, defaults: dict | None = None) -> Admission:
    return Admission(tokenizer, MAX_LEN, len(tokenizer), BlockManager(64, 16), defaults)


def test_token_ids_longer_than_the_context_are_cut_when_asked(tokenizer):
    """As vLLM's: truncate_prompt_tokens cuts a token-id prompt too, however long it came; uncut, it is refused."""
    admission = _admission(tokenizer)
    ids = [i % 500 + 3 for i in range(1000)]
    with pytest.raises(RequestError, match=r"^prompt \(1000 tokens\) exceeds max_model_len \(256\)"):
        admission.admit(ids, SamplingParams(max_tokens=4))
    prompt_ids, params = admission.admit(ids, SamplingParams(max_tokens=4, truncate_prompt_tokens=10))
    assert prompt_ids == ids[-10:] and params.max_tokens == 4
    with pytest.raises(RequestError, match=r"^prompt \(256 tokens\) leaves no room for output tokens"):
        admission.admit(ids, SamplingParams(max_tokens=None, truncate_prompt_tokens=-1))  # -1: max_model_len
    prompt_ids, params = admission.admit(ids, SamplingParams(max_tokens=None, truncate_prompt_tokens=MAX_LEN - 1))
    assert prompt_ids == ids[1 - MAX_LEN :] and params.max_tokens == 1


def test_an_unset_max_tokens_is_the_room_left_capped_by_the_models_max_new_tokens(tokenizer):
    plain, capped = _admission(tokenizer), _admission(tokenizer, {"max_tokens": 7})
    ids = list(range(10, 250))  # 16 tokens of room
    assert plain.admit(ids, SamplingParams(max_tokens=None)).params.max_tokens == MAX_LEN - len(ids)
    assert capped.admit(ids, SamplingParams(max_tokens=None)).params.max_tokens == 7
    assert capped.admit(ids[:-12] + ids[-3:], SamplingParams(max_tokens=None)).params.max_tokens == 7
    assert capped.admit(ids + [5] * 12, SamplingParams(max_tokens=None)).params.max_tokens == 4  # room < 7
    assert capped.admit(ids, SamplingParams(max_tokens=12)).params.max_tokens == 12  # a limit given is kept
    # a cut prompt's room is counted after the cut
    cut = capped.admit(ids, SamplingParams(max_tokens=None, truncate_prompt_tokens=20))
    assert len(cut.prompt_ids) == 20 and cut.params.max_tokens == 7
    with pytest.raises(RequestError, match=r"^min_tokens must be in \[0, max_tokens\].*7 tokens left"):
        capped.admit(ids, SamplingParams(max_tokens=None, min_tokens=9))


def test_a_request_without_params_takes_the_models_generation_defaults(tokenizer):
    defaults = {"temperature": 0.25, "top_k": 3, "repetition_penalty": 1.5, "max_tokens": 7}
    admission = _admission(tokenizer, defaults)
    prompt_ids, params = admission.admit("hello there", None)
    assert prompt_ids == tokenizer.encode("hello there", add_special_tokens=False)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (0.25, 3, 1.5, 7)
    assert _admission(tokenizer).admit("hello", None).params == SamplingParams()  # none: SamplingParams' own
    given = SamplingParams(max_tokens=None)
    admission.admit("hello", given)
    assert given.max_tokens is None  # resolved in a copy: the caller's params may serve other prompts
    bad = _admission(tokenizer, {"temperature": -1.0})
    with pytest.raises(RequestError, match=r"^temperature must be in \[0, 100\].*generation_config\.json"):
        bad.admit("hello", None)


def _seq(prompt_len: int, **params) -> Sequence:
    return Sequence("r", list(range(3, 3 + prompt_len)), prompt_len, SamplingParams(**params), 0.0)


def test_the_token_stop_check():
    eos = {2}
    seq = _seq(4, max_tokens=3, min_tokens=1, stop_token_ids=[9])
    seq.token_ids.append(2)
    assert seq.token_stop(2, eos) == ("stop", None)  # EOS, once min_tokens (1) are out
    seq = _seq(4, max_tokens=3, min_tokens=2, stop_token_ids=[9])
    seq.token_ids.append(2)
    assert seq.token_stop(2, eos) is None  # min_tokens not reached: EOS ignored
    seq.token_ids.append(9)
    assert seq.token_stop(9, eos) == ("stop", 9)  # a stop id names itself
    seq.token_ids[-1] = 2
    assert seq.token_stop(2, eos) == ("stop", None)
    seq.token_ids.append(5)
    assert seq.token_stop(5, eos) == ("length", None) and seq.all_sampled
    ignoring = _seq(4, max_tokens=5, ignore_eos=True)
    ignoring.token_ids.append(2)
    assert ignoring.token_stop(2, eos) is None
    # a placeholder of a step in flight counts for the scheduler (all_sampled), not for the stop
    pending = _seq(4, max_tokens=2)
    pending.token_ids += [7, -1]
    pending.num_pending = 1
    assert pending.all_sampled and pending.token_stop(7, eos) is None


def test_llm_without_params_samples_with_the_models_generation_defaults(tiny_tied, tmp_path):
    """vLLM's LLM.generate(prompts) without sampling_params: the model's generation_config.json (here top_k=1, so
    greedy, and max_new_tokens=7), through the engine's admission as every front-end's request."""
    from nanoserve import LLM

    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 7}))
    args = dict(device="cpu", max_model_len=256, num_kv_blocks=64, generation_config=str(gen))
    with LLM(str(tiny_tied), **args) as llm:
        (plain,) = llm.generate("once upon a time", use_tqdm=False)
        (greedy,) = llm.generate("once upon a time", SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)
    assert plain.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert len(plain.outputs[0].token_ids) <= 7
