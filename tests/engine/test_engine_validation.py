"""Request validation, stop conditions and outputs, through a real ``client.LLM`` (coordinator in this
process, a real worker process over ZMQ) on the tiny checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from nanoserve import LLM, SamplingParams
from protocol.codec import decode, encode
from protocol.errors import RequestError

NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 16, 16, 512
PROMPT = np.random.default_rng(1).integers(3, 500, 12).tolist()


@pytest.fixture(scope="module")
def llm(tiny_tied):
    with LLM(
        str(tiny_tied),
        device="cpu",
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
    ) as llm:
        yield llm


def greedy(max_tokens: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy continuation of PROMPT, run to 24 tokens."""
    out = llm.generate(PROMPT, greedy(24, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    return out


def assert_engine_clean_and_serving(llm) -> None:
    eng = llm.engine
    assert not eng.requests and not eng.scheduler.has_work and not eng.output_processor.states
    assert eng.block_manager.num_free_blocks == NUM_BLOCKS
    out = llm.generate([PROMPT], greedy(3, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and len(out[0].token_ids) == 3 and out[0].finish_reason == "length"


# ---- sampling parameters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("temperature", float("nan")),
        ("temperature", "1"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 2),
        ("min_p", -0.1),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("seed", -(2**63) - 1),
        ("seed", 2**63),
        ("stop", [""]),
        ("stop", 123),
        ("stop", {"a": 1}),
        ("stop", b"ab"),
        ("stop", ["a", 1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 5),
        ("stop_token_ids", "5"),
        ("stop_token_ids", {5: 1}),
        ("ignore_eos", 1),
        ("logprobs", 21),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: float("inf")}),
        ("logit_bias", {3: "1"}),
        ("logit_bias", [(3, 1.0)]),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


def test_sampling_params_take_vllms_spellings():
    assert SamplingParams(stop="a").stop == ["a"] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    params = SamplingParams(max_tokens=None, min_tokens=5)  # None: up to max_model_len
    assert params.max_tokens is None and decode(encode(params)) == params


def test_params_made_invalid_after_construction_are_refused_by_the_engine(llm):
    params = SamplingParams(max_tokens=4)
    params.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(PROMPT, params, use_tqdm=False)
    assert_engine_clean_and_serving(llm)


def test_huge_top_k_means_no_top_k(llm, reference):
    """Any top_k >= 1 is valid; one beyond int32 must not break the step it is sent in."""
    out = llm.generate(PROMPT, greedy(24, ignore_eos=True, top_k=2**40), use_tqdm=False)[0]
    assert out.token_ids == reference.token_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, top_k=2**40, seed=3), use_tqdm=False)[0]
    assert len(out.token_ids) == 4
    assert_engine_clean_and_serving(llm)


def test_unknown_engine_argument_is_a_type_error(tiny_tied):
    with pytest.raises(TypeError, match="unknown engine argument.*max_num_sequences"):
        LLM(str(tiny_tied), device="cpu", max_num_sequences=4)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_tied), device="cpu", block_size=12)
    with pytest.raises(ValueError, match="async_depth must be 1 or 2"):
        LLM(str(tiny_tied), device="cpu", async_depth=3)


# ---- bad requests --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", None, "prompt is empty"),
        (list(range(500)), greedy(20), r"exceeds max_model_len \(512\)"),
        ([5, 512, 7], None, r"out of vocabulary \[0, 512\): \[512\]"),
        ([5, -1], None, "out of vocabulary"),
        ([5, 2.0], None, "prompt must be a string or a list of token ids"),
        ([5, True], None, "prompt must be a string or a list of token ids"),
        (list(range(250)), greedy(100), "needs more KV blocks than the pool has"),
        (PROMPT, greedy(4, stop_token_ids=[512]), "stop_token_ids"),
        (PROMPT, greedy(4, logit_bias={5: 1.0, 512: -1.0}), "^logit_bias token ids must be below"),
        (PROMPT, greedy(None), "needs more KV blocks.*: max_tokens=None asks for all of max_model_len"),
        (list(range(512)), greedy(None), r"prompt \(512 tokens\) leaves no room for output tokens in max_model_len"),
        (PROMPT, greedy(None, min_tokens=501), r"min_tokens must be in \[0, max_tokens\].*500 tokens left"),
    ],
    ids=[
        "empty",
        "too-long",
        "id-over-vocab",
        "negative-id",
        "float-id",
        "bool-id",
        "pool-too-small",
        "stop-id-over-vocab",
        "bias-id-over-vocab",
        "rest-of-context-past-pool",
        "rest-of-context-none-left",
        "rest-of-context-below-min-tokens",
    ],
)
def test_bad_request_is_refused_and_engine_keeps_serving(llm, prompt, params, message):
    with pytest.raises(RequestError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    assert_engine_clean_and_serving(llm)


def test_one_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.generate([PROMPT, PROMPT[:3], ""], greedy(4), use_tqdm=False)
    assert_engine_clean_and_serving(llm)


def test_request_filling_the_pool_exactly_is_served(llm):
    prompt = np.random.default_rng(2).integers(0, 500, NUM_BLOCKS * BLOCK_SIZE - 8).tolist()
    out = llm.generate(prompt, greedy(8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 8
    assert_engine_clean_and_serving(llm)


# ---- stop conditions -----------------------------------------------------------------------------------


def test_stop_token_ids_end_generation(llm, reference):
    toks = reference.token_ids
    k = next(i for i in range(3, len(toks)) if toks[i] not in toks[:i])
    out = llm.generate(PROMPT, greedy(24, stop_token_ids=[toks[k]], ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == toks[k]
    assert out.token_ids == toks[: k + 1]
    # min_tokens past k: the stop token is masked (vLLM) until k + 2 tokens exist, so greedy takes another token
    params = greedy(24, stop_token_ids=[toks[k]], ignore_eos=True, min_tokens=k + 2)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(out.token_ids) >= k + 2 and out.token_ids[:k] == toks[:k]
    assert toks[k] not in out.token_ids[: k + 2]
    assert toks[k] not in out.token_ids[:-1] and out.finish_reason == ("stop" if toks[k] in out.token_ids else "length")


def _stop_string_case(llm, reference) -> tuple[str, int, int]:
    """A stop string from the reference text: (stop, its index in the text, tokens needed to complete it)."""
    tok = llm.tokenizer
    toks = reference.token_ids
    text = tok.decode(toks, skip_special_tokens=True)
    for idx in range(2, len(text) - 2):
        stop = text[idx : idx + 2]
        if stop.isascii() and stop.strip() == stop and stop.isprintable() and text.find(stop) == idx:
            needed = next(j for j in range(1, len(toks) + 1) if stop in tok.decode(toks[:j], skip_special_tokens=True))
            if needed < len(toks):
                return stop, idx, needed
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_ends_generation_and_is_not_in_text(llm, reference):
    stop, idx, needed = _stop_string_case(llm, reference)
    text = llm.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    out = llm.generate(PROMPT, greedy(24, stop=[stop, "\x00never"], ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:idx] and stop not in out.text
    assert out.token_ids == reference.token_ids[:needed]


def test_stop_string_completed_by_the_last_allowed_token(llm, reference):
    """The stop string wins over the length limit when both happen on one token (vLLM does the same)."""
    stop, idx, needed = _stop_string_case(llm, reference)
    text = llm.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    out = llm.generate(PROMPT, greedy(needed, stop=stop, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == reference.token_ids[:needed]
    assert out.finish_reason == "stop" and out.text == text[:idx]


# ---- EOS and min_tokens --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_llm(tiny_tied, tmp_path_factory, reference):
    """The same model with the reference's first greedy token declared as EOS (config.json eos_token_id)."""
    d = Path(tmp_path_factory.mktemp("eos")) / "model"
    shutil.copytree(tiny_tied, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = reference.token_ids[0]
    (d / "config.json").write_text(json.dumps(cfg))
    with LLM(str(d), device="cpu", num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def test_eos_stops_and_min_tokens_holds_it_off(eos_llm, reference):
    eos = reference.token_ids[0]
    out = eos_llm.generate(PROMPT, greedy(10), use_tqdm=False)[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = eos_llm.generate(PROMPT, greedy(10, min_tokens=5), use_tqdm=False)[0]
    assert len(out.token_ids) >= 5
    assert out.finish_reason == ("stop" if out.token_ids[-1] == eos else "length")
    assert eos not in out.token_ids[5:-1]  # after min_tokens, the first EOS ends it
    out = eos_llm.generate(PROMPT, greedy(10, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_min_tokens_masks_eos_like_vllm(eos_llm, reference):
    eos = reference.token_ids[0]
    out = eos_llm.generate(PROMPT, greedy(10, min_tokens=5), use_tqdm=False)[0]
    assert eos not in out.token_ids[:5] and len(out.token_ids) >= 5
    # EOS and stop ids together, greedy and sampled (at a low temperature EOS would win), in a batch with an
    # unmasked request
    banned = {eos, *reference.token_ids[1:3]}
    params = [
        SamplingParams(temperature=t, max_tokens=12, min_tokens=8, stop_token_ids=sorted(banned - {eos}), seed=s)
        for t, s in [(0.0, None), (0.05, 1), (0.3, 2), (1.0, 3)]
    ]
    outs = eos_llm.generate([PROMPT] * len(params) + [PROMPT], params + [greedy(3)], use_tqdm=False)
    for out in outs[:-1]:
        assert not banned & set(out.token_ids[:8]), out.token_ids
        assert len(out.token_ids) >= 8
    assert outs[-1].token_ids == [eos]  # the unmasked request in the same batch still stops at once
    # ignore_eos: EOS is not masked (nor does it stop the request); the stop ids still are
    out = eos_llm.generate(PROMPT, greedy(6, min_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids[0] == eos


# ---- outputs -------------------------------------------------------------------------------------------


def test_text_is_decoded_in_the_step_that_finishes_the_request(llm, reference):
    """LLM.generate returns without a decoding pass over every request: a request that is not streamed has one
    output, from the step that finishes it, with its whole text (decoded while the worker runs the steps already
    sent)."""
    eng = llm.engine
    rid = eng.add_request(PROMPT, greedy(24, ignore_eos=True))
    outs = []
    while not outs:
        outs = [o for o in eng.step() if o.request_id == rid]
    (out,) = outs
    text = llm.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    assert out.finished and out.text == text and out.token_ids == reference.token_ids
    assert out.completion().text == text and out.prompt_token_ids == PROMPT
    while eng.has_unfinished:  # steps sent past the end (async scheduling) drain
        eng.step()
    assert_engine_clean_and_serving(llm)


def test_streamed_outputs_add_up_to_the_completion(llm, reference):
    """Through the engine: a streamed request's outputs (one per step) hold its tokens and text, cut at a stop
    string the output processor found, which also frees the request's blocks in the scheduler."""
    stop, idx, needed = _stop_string_case(llm, reference)
    text = llm.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    eng = llm.engine
    rid = eng.add_request(PROMPT, greedy(24, stop=[stop], ignore_eos=True, logprobs=2), stream=True)
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in eng.step() if o.request_id == rid]
    assert all(len(o.token_ids) == 1 == len(o.logprobs) for o in outs)
    assert [t for o in outs for t in o.token_ids] == reference.token_ids[:needed]
    assert "".join(o.text for o in outs) == text[:idx]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    while eng.has_unfinished:
        eng.step()
    assert_engine_clean_and_serving(llm)


def test_stop_string_kept_in_output_when_asked(llm, reference):
    stop, idx, needed = _stop_string_case(llm, reference)
    text = llm.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    params = greedy(24, stop=stop, ignore_eos=True, include_stop_str_in_output=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == text[: idx + len(stop)]
    assert out.token_ids == reference.token_ids[:needed]


def test_several_completions_per_prompt(llm):
    """The engine takes n=1 per request and says so; LLM.generate serves n as n requests (one prefill, shared)."""
    with pytest.raises(RequestError, match=r"n must be 1 per engine request.*got 2"):
        llm.engine.add_request(PROMPT, SamplingParams(n=2))
    assert_engine_clean_and_serving(llm)
    one = llm.generate(PROMPT, greedy(6, ignore_eos=True), use_tqdm=False)[0]
    (out,) = llm.generate(PROMPT, greedy(6, ignore_eos=True, n=3), use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == one.token_ids and o.text == one.text for o in out.outputs)
    assert_engine_clean_and_serving(llm)


def test_abort_returns_the_last_output(llm, reference):
    eng = llm.engine
    start = eng.stats()["output_tokens"]
    rid = eng.add_request(PROMPT, greedy(24, ignore_eos=True))
    while eng.stats()["output_tokens"] < start + 3:
        assert not eng.step()  # a request that is not streamed has no output before its end
    out = eng.abort(rid)
    n = len(out.token_ids)
    assert out.finish_reason == "abort" and 0 < n < 24 and out.token_ids == reference.token_ids[:n]
    assert eng.abort(rid) is None
    while eng.has_unfinished:
        assert not eng.step()  # the steps still in flight carry no output for it
    assert_engine_clean_and_serving(llm)
