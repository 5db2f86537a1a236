"""The OpenAI-compatible HTTP server end to end: ``python launch.py --http-port 0`` in a subprocess (coordinator,
worker and front-end processes, real sockets), driven by the real ``openai`` SDK and httpx; HF transformers on
the same float32 checkpoint is the oracle for greedy text and logprobs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from client import Client
from model.tiny import CHAT_TEMPLATE, TinySpec, write_tiny_checkpoint
from protocol.sampling_params import SamplingParams
from tests.support.hf_oracle import Oracle
from tests.support.openai_http import HttpServer, http_post, metric
from tests.support.timeouts import HANG_S

NAME = "tiny-chat"
ALIAS = "tiny-chat-alias"  # a second --served-model-name: requests may use it, responses say NAME
GEN_MAX_NEW_TOKENS = 20  # generation_config.json's max_new_tokens: chat's default max_tokens
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint (it has a chat template) with sampling defaults in generation_config.json: top_k=1
    makes a request that leaves sampling unset greedy."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_chat"), TinySpec(seed=5))
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(top_k=1, max_new_tokens=GEN_MAX_NEW_TOKENS)
    (path / "generation_config.json").write_text(json.dumps(gen))
    # as a thinking model's template, with {"thinking": true} the prompt ends in an open <think> block
    template = CHAT_TEMPLATE.replace(
        "assistant\n{% endif %}", "assistant\n{% if thinking %}<think>\n{% endif %}{% endif %}"
    )
    assert template != CHAT_TEMPLATE
    (path / "chat_template.jinja").write_text(template)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    flags = ["--served-model-name", NAME, ALIAS, "--log-stats-interval", "1", "--reasoning-parser", "qwen3"]
    with HttpServer(model_dir, tmp_path_factory.mktemp("http") / "server.log", *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def hf(model_dir) -> Oracle:
    return Oracle(model_dir)


# ---- parity with HF ----------------------------------------------------------------------------------------


def test_completions_equal_hf_greedy(api, hf):
    prompts = ["def hello(", "the quick brown fox"]
    r = api.completions.create(model=NAME, prompt=prompts, max_tokens=12, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, c in zip(prompts, r.choices):
        assert c.text == hf.text(hf.greedy(hf.ids(prompt), 12))
        assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(len(hf.ids(p)) for p in prompts)
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.model == NAME and r.object == "text_completion"
    ids = [5, 17, 300, 42, 7]  # token ids
    r = api.completions.create(model=NAME, prompt=ids, max_tokens=12, **GREEDY)
    assert r.choices[0].text == hf.text(hf.greedy(ids, 12)) and r.usage.prompt_tokens == 5
    # sampling fields left unset come from generation_config.json: top_k=1, so greedy at temperature 1
    r = api.completions.create(model=NAME, prompt=prompts[0], max_tokens=16, extra_body={"ignore_eos": True})
    assert r.choices[0].text == hf.text(hf.greedy(hf.ids(prompts[0]), 16))
    # a list of token-id lists, and echo
    r = api.completions.create(model=NAME, prompt=[[9, 8, 7], [1, 2]], max_tokens=5, echo=True, **GREEDY)
    for ids, c in zip([[9, 8, 7], [1, 2]], r.choices):
        assert c.text == hf.tok.decode(ids) + hf.text(hf.greedy(ids, 5))


def test_chat_continues_the_final_message_as_hf_renders_it(api, hf):
    """vLLM's continue_final_message: the assistant's last message is continued, not closed (a reply prefilled)."""
    messages = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Well, I"}]
    text = hf.tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("Well, I")  # the turn is left open
    ids = hf.ids(text)
    extra = dict(GREEDY["extra_body"], continue_final_message=True, add_generation_prompt=False)
    r = api.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == hf.text(hf.greedy(ids, 8))
    assert r.usage.prompt_tokens == len(ids)


def test_chat_equals_hf_greedy_plain_and_streaming(api, hf):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there!"}]
    ids = hf.chat_ids(messages)
    expected = hf.text(hf.greedy(ids, GEN_MAX_NEW_TOKENS))
    r = api.chat.completions.create(model=NAME, messages=messages, max_tokens=10, **GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == hf.text(hf.greedy(ids, 10))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)
    # no max_tokens: the rest of the context, capped by generation_config.json's max_new_tokens
    r = api.chat.completions.create(model=NAME, messages=messages, **GREEDY)
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == GEN_MAX_NEW_TOKENS and r.choices[0].finish_reason == "length"
    # text parts are joined, as OpenAI's content arrays allow
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]
    r = api.chat.completions.create(model=NAME, messages=parts, max_tokens=10, **GREEDY)
    assert r.choices[0].message.content == hf.text(hf.greedy(ids, 10))

    chunks = list(
        api.chat.completions.create(
            model=NAME, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert all(c.usage is None for c in chunks[:-1])  # without continuous_usage_stats, the last event alone
    every = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=NAME, messages=messages, stream=True, stream_options=every, **GREEDY)
    chunks = list(api.chat.completions.create(**kw))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == GEN_MAX_NEW_TOKENS and counts[0] >= 1
    assert {c.usage.prompt_tokens for c in chunks} == {len(ids)}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == GEN_MAX_NEW_TOKENS
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_reasoning_parser_reads_a_block_the_prompt_opened(api, server):
    """The tiny model never writes </think>: behind a prompt that opened the block, its whole output is
    reasoning_content (streamed the same), with content None; behind a plain prompt the parser leaves it alone."""
    msgs = [{"role": "user", "content": "hi"}]
    plain = api.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, **GREEDY).choices[0].message
    assert plain.content and getattr(plain, "reasoning_content", None) is None
    think = {"ignore_eos": True, "chat_template_kwargs": {"thinking": True}}
    args = dict(model=NAME, messages=msgs, max_tokens=8, temperature=0, extra_body=think)
    message = api.chat.completions.create(**args).choices[0].message
    assert message.content is None and message.reasoning_content
    chunks = list(api.chat.completions.create(**args, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) == (
        message.reasoning_content
    )
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # the same tokens as a completion of the rendered prompt: the parser only relabels them
    ids = http_post(f"{server.root}/tokenize", json={"model": NAME, "messages": msgs, **think}).json()["tokens"]
    completion = api.completions.create(model=NAME, prompt=ids, max_tokens=8, **GREEDY)
    assert completion.choices[0].text == message.reasoning_content


def test_n_choices_share_one_prefill(api, server):
    prompt = np.random.default_rng(11).integers(3, 500, 100).tolist()  # 6 full blocks of 16, not seen before
    hits, queries = (
        metric(server, "nanoserve:prefix_cache_hits_total"),
        metric(server, "nanoserve:prefix_cache_queries_total"),
    )
    kw = dict(model=NAME, prompt=prompt, max_tokens=8, n=2, temperature=1.0, top_p=1.0, seed=1234)
    r = api.completions.create(**kw, extra_body={"top_k": 0, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == 100
    assert r.choices[0].text != r.choices[1].text  # each choice samples with its own seed (seed + index)
    again = api.completions.create(**kw, extra_body={"top_k": 0, "ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    # the first run computed the prompt once: the second choice found its 6 full blocks in the prefix cache
    # (the second run hit 12 blocks). Tokens computed = queries - hits.
    d_hits = metric(server, "nanoserve:prefix_cache_hits_total") - hits
    d_computed = metric(server, "nanoserve:prefix_cache_queries_total") - queries - d_hits
    assert d_hits == 96 * 3 and d_computed == 100 + 4 + 4 + 4


def test_stop_strings(api, hf):
    prompt = "import os"
    full = hf.text(hf.greedy(hf.ids(prompt), 24))
    stop = full[10:13]
    cut = full[: full.index(stop)]
    kw = dict(model=NAME, prompt=prompt, max_tokens=24, stop=[stop, "\x00never"], **GREEDY)
    r = api.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    assert r.choices[0].stop_reason == stop  # vLLM's extra field
    every = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's: the usage so far in every event
    streamed = list(api.completions.create(stream=True, stream_options=every, **kw))
    chunks, usage = streamed[:-1], streamed[-1].usage
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # one event per token, as vLLM streams: the stop string's first characters are held back, their events empty
    assert len(chunks) == usage.completion_tokens
    assert [c.usage.completion_tokens for c in chunks] == list(range(1, len(chunks) + 1))
    assert {c.usage.prompt_tokens for c in chunks} == {usage.prompt_tokens} == {len(hf.ids(prompt))}
    assert any(c.choices[0].text == "" for c in chunks[:-1])


def test_include_stop_str_in_output(api, hf):
    prompt = "import os"
    full = hf.text(hf.greedy(hf.ids(prompt), 24))
    stop = full[10:13]
    kept = full[: full.index(stop) + len(stop)]
    extra = dict(GREEDY["extra_body"], include_stop_str_in_output=True)
    kw = dict(model=NAME, prompt=prompt, max_tokens=24, stop=[stop], temperature=0, extra_body=extra)
    r = api.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].stop_reason) == (kept, "stop", stop)
    streamed = list(api.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == kept


def test_min_tokens_shields_stop_strings_and_stop_tokens_leave_their_text_out(api, server, hf):
    """vLLM's: a stop string only matches after the first min_tokens tokens' text; a stop id or EOS that ends the
    request keeps its id (counted, with logprobs) but not its text, over HTTP (plain and streamed) and ZMQ."""
    prompt, extra = "import os", GREEDY["extra_body"]
    ids = hf.greedy(hf.ids(prompt), 24)
    full, shielded = hf.text(ids), len(hf.text(ids[:16]))
    stop = full[2:4]
    assert full.index(stop) + len(stop) <= shielded  # its first match is within the shielded text
    at = full.find(stop, shielded - len(stop) + 1)
    want = (full, "length") if at < 0 else (full[:at], "stop")
    kw = dict(model=NAME, prompt=prompt, max_tokens=24, stop=[stop], temperature=0)
    kw["extra_body"] = dict(extra, min_tokens=16)
    r = api.completions.create(**kw).choices[0]
    assert (r.text, r.finish_reason) == want
    assert "".join(c.choices[0].text for c in api.completions.create(stream=True, **kw)) == want[0]
    k = 5 + next(j for j, t in enumerate(ids[5:]) if t not in ids[:5])  # a token's first occurrence
    cut = hf.text(ids[:k])
    kw = dict(model=NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=0)
    r = api.completions.create(**kw, extra_body=dict(extra, stop_token_ids=[ids[k]]))
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.stop_reason, r.usage.completion_tokens) == (cut, "stop", ids[k], k + 1)
    assert len(c.logprobs.tokens) == k + 1
    assert c.logprobs.text_offset[-1] == len(cut)  # the stop token's entry starts where the text ends
    del kw["logprobs"]
    chunks = list(api.completions.create(stream=True, **kw, extra_body=dict(extra, stop_token_ids=[ids[k]])))
    assert "".join(ch.choices[0].text for ch in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
    with Client(server.zmq, timeout=HANG_S) as client:
        out = client.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ids[k]]))
    assert (out.text, out.token_ids) == (cut, ids[: k + 1])
    # EOS (forced by a bias): its text comes out only with include_stop_str_in_output
    for keep in (False, True):
        extra_eos = dict(logit_bias={"0": 100}, skip_special_tokens=False, include_stop_str_in_output=keep)
        c = api.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra_eos)
        assert (c.choices[0].text, c.choices[0].finish_reason) == ("<|endoftext|>" if keep else "", "stop")


def test_skip_special_tokens(api, server, hf):
    """Seeded sampling over the whole vocabulary draws special tokens; the text keeps them only when asked. The
    same request over ZMQ gives the token ids (the same seed samples the same tokens)."""
    params = dict(temperature=3.0, top_k=0, max_tokens=40, seed=19, ignore_eos=True)
    with Client(server.zmq, timeout=HANG_S) as c:
        ids = c.generate("Hello", SamplingParams(**params)).token_ids
    assert {0, 1, 2} & set(ids)  # <|endoftext|>, <|im_start|>, <|im_end|>: the test needs one
    for skip in (True, False):
        extra = dict(top_k=0, seed=19, ignore_eos=True, skip_special_tokens=skip)
        kw = dict(model=NAME, prompt="Hello", max_tokens=40, temperature=3.0, extra_body=extra)
        assert api.completions.create(**kw).choices[0].text == hf.tok.decode(ids, skip_special_tokens=skip)
        streamed = "".join(ch.choices[0].text for ch in api.completions.create(stream=True, **kw))
        assert streamed == hf.tok.decode(ids, skip_special_tokens=skip)


def test_logprobs_equal_hf(api, hf):
    prompt = "class Foo:"
    ids = hf.ids(prompt)
    r = api.completions.create(model=NAME, prompt=prompt, max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    out = hf.greedy(ids, 6)
    ref = hf.logprobs(ids, out)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for i, t in enumerate(out):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-4)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)  # greedy
        top3 = torch.topk(ref[i], 3).values.tolist()
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:3] == pytest.approx(top3, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    messages = [{"role": "user", "content": "hi"}]
    cids = hf.chat_ids(messages)
    r = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = r.choices[0].logprobs.content
    cout = hf.greedy(cids, 4)
    cref = hf.logprobs(cids, cout)
    assert [e.token for e in content] == [hf.tok.decode([t]) for t in cout]
    for i, e in enumerate(content):
        assert e.logprob == pytest.approx(cref[i, cout[i]].item(), abs=1e-4)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(torch.topk(cref[i], 2).values.tolist(), abs=1e-4)
        assert e.bytes == list(e.token.encode())


def test_sixteen_concurrent_streams_equal_hf(server, hf):
    prompts = [np.random.default_rng(i).integers(3, 500, 5 + 3 * i).tolist() for i in range(16)]
    sequential = [hf.text(hf.greedy(p, 12)) for p in prompts]  # one at a time, batch of one

    async def stream_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=HANG_S)

        async def one(p) -> str:
            parts = []
            async for chunk in await client.completions.create(
                model=NAME, prompt=p, max_tokens=12, stream=True, **GREEDY
            ):
                parts.append(chunk.choices[0].text)
            return "".join(parts)

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(stream_all()) == sequential
