"""The OpenAI-compatible HTTP server end to end: ``python launch.py --http-port 0`` in a subprocess (coordinator,
worker and front-end processes, real sockets), driven by the real ``openai`` SDK and httpx; HF transformers on
the same float32 checkpoint is the oracle for greedy text and logprobs."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from client import Client
from model.tiny import CHAT_TEMPLATE, TinySpec, write_tiny_checkpoint
from protocol.sampling_params import SamplingParams
from tests.support.hf_oracle import Oracle
from tests.support.openai_http import HttpServer, metric, metrics
from tests.support.processes import ROOT

NAME = "tiny-chat"
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
    flags = ["--served-model-name", NAME, "--log-stats-interval", "1", "--reasoning-parser", "qwen3"]
    with HttpServer(model_dir, tmp_path_factory.mktemp("http") / "server.log", *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


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
    ids = httpx.post(f"{server.root}/tokenize", json={"model": NAME, "messages": msgs, **think}).json()["tokens"]
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
    streamed = list(api.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    chunks, usage = streamed[:-1], streamed[-1].usage
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # one event per token, as vLLM streams: the stop string's first characters are held back, their events empty
    assert len(chunks) == usage.completion_tokens
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
    with Client(server.zmq, timeout=60) as client:
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
    params = dict(temperature=3.0, top_k=0, max_tokens=300, seed=11, ignore_eos=True)
    with Client(server.zmq, timeout=120) as c:
        ids = c.generate("Hello", SamplingParams(**params)).token_ids
    assert {0, 1, 2} & set(ids)  # <|endoftext|>, <|im_start|>, <|im_end|>: the test needs one
    for skip in (True, False):
        extra = dict(top_k=0, seed=11, ignore_eos=True, skip_special_tokens=skip)
        kw = dict(model=NAME, prompt="Hello", max_tokens=300, temperature=3.0, extra_body=extra)
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
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)

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


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    aborted = metric(server, "nanoserve:request_success_total", finished_reason="abort")
    generated = metric(server, "nanoserve:generation_tokens_total")
    body = {"model": NAME, "prompt": "once upon a time", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.base_url + "/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while True:
        m = metrics(server)
        running = m[("nanoserve:num_requests_running", ())]
        usage = m[("nanoserve:kv_cache_usage_perc", ())]
        if (running, usage) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (running, usage) == (0, 0)
    assert metric(server, "nanoserve:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(server, "nanoserve:generation_tokens_total") - generated < 480
    # a request that does not stream, its client gone once it runs: aborted and counted as one too
    host, port = server.root.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": False}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 20
        while not metric(server, "nanoserve:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.01)
    deadline = time.monotonic() + 20
    while metric(server, "nanoserve:request_success_total", finished_reason="abort") == aborted + 1:
        assert time.monotonic() < deadline, "the abandoned request was not counted"
        time.sleep(0.05)
    assert metric(server, "nanoserve:request_success_total", finished_reason="abort") == aborted + 2
    assert metric(server, "nanoserve:generation_tokens_total") - generated < 2 * 480


# ---- the rest of the API -----------------------------------------------------------------------------------


def _error(resp: httpx.Response, status: int, param) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == status
    return err["message"]


def test_errors_name_the_field_and_the_server_keeps_serving(api, server):
    url = server.base_url + "/completions"
    assert "temperature" in _error(httpx.post(url, json={"prompt": "x", "temperature": -1}), 400, "temperature")
    assert "max_tokens" in _error(httpx.post(url, json={"prompt": "x", "max_tokens": "many"}), 400, "max_tokens")
    assert "prompt" in _error(httpx.post(url, json={"prompt": ["a", [1]]}), 400, "prompt")
    assert "max_model_len" in _error(httpx.post(url, json={"prompt": "x", "max_tokens": 900}), 400, "max_tokens")
    assert "vocabulary" in _error(httpx.post(url, json={"prompt": [10**6]}), 400, "prompt")
    assert "n " in _error(httpx.post(url, json={"prompt": "x", "n": 0}), 400, "n")
    assert "model" in _error(httpx.post(url, json={"prompt": "x", "model": "gpt-9"}), 404, "model")
    _error(httpx.post(url, json={"prompt": "x", "guided_regex": "a+"}), 400, "guided_regex")  # refused, not ignored
    _error(httpx.post(url, json={"prompt": "x", "stop": ""}), 400, "stop")  # as [""], not silently no stop
    only_streams = {"prompt": "x", "stream_options": {"include_usage": True}}
    assert "stream=true" in _error(httpx.post(url, json=only_streams), 400, "stream_options")
    chat = server.base_url + "/chat/completions"
    _error(httpx.post(chat, json={"messages": []}), 400, "messages")
    _error(
        httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400, "top_logprobs"
    )
    too_many = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}
    assert "top_logprobs must be in [0, 20]" in _error(httpx.post(chat, json=too_many), 400, "top_logprobs")
    not_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert "not valid JSON" in _error(not_json, 400, None)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], top_p=0)
    # an unknown field is ignored (with a warning in the log), as vLLM does
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, "no_such_field": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_tokenize_detokenize_models_version_health(server, hf):
    text = "Hello world, Ünïcödé"
    r = httpx.post(server.root + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == hf.tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert r["token_strs"] == [hf.tok.decode([t]) for t in r["tokens"]]
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.root + "/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == hf.chat_ids(messages)
    r = httpx.post(server.root + "/detokenize", json={"tokens": hf.tok.encode(text)}).json()
    assert r["prompt"] == text
    special = "<|im_start|>user\nhi<|im_end|>"  # as vLLM's, special tokens are kept: the round trip holds
    ids = httpx.post(server.root + "/tokenize", json={"prompt": special}).json()["tokens"]
    assert httpx.post(server.root + "/detokenize", json={"tokens": ids}).json()["prompt"] == special
    assert "vocabulary" in _error(httpx.post(server.root + "/detokenize", json={"tokens": [99999]}), 400, "tokens")
    models = httpx.get(server.base_url + "/models").json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["data"][0]["max_model_len"] == 512
    assert time.time() - 600 < models["data"][0]["created"] <= time.time()  # when the server started, as vLLM's
    assert httpx.get(server.root + "/version").json()["version"]
    assert httpx.get(server.root + "/health").status_code == 200


def test_metrics_names_parse_and_logs(server, api):
    api.completions.create(model=NAME, prompt="metrics", max_tokens=4, stream=False, **GREEDY)
    list(api.completions.create(model=NAME, prompt="metrics", max_tokens=4, stream=True, **GREEDY))
    m = metrics(server)
    names = {name for name, _ in m}
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"nanoserve:{gauge}" in names
    for counter in ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits"):
        assert f"nanoserve:{counter}_total" in names
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert m[(f"nanoserve:{hist}_count", ())] > 0
    assert m[("nanoserve:request_success_total", (("finished_reason", "length"),))] > 0
    time.sleep(1.5)  # one stats interval: the periodic line covers the requests above
    log = server.stderr()
    assert re.search(r"cmpl-\w+ finished: \d+ prompt \+ 4 output tokens, [\d.]+ s, finish_reason=length", log)
    assert "Avg generation throughput" in log and "KV cache usage" in log
    assert "no_such_field" in log


def test_readme_chat_example_runs(server, api):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## OpenAI-compatible HTTP API") :]
    code = section[
        section.index("```python") + len("```python") : section.index("```\n", section.index("```python") + 9)
    ]
    assert "http://127.0.0.1:8000/v1" in code
    code = code.replace("http://127.0.0.1:8000/v1", server.base_url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    messages = [{"role": "user", "content": "Write a haiku about GPUs."}]
    same = api.chat.completions.create(model=NAME, messages=messages, max_tokens=64)  # greedy: top_k=1 default
    assert out.stdout == same.choices[0].message.content + "\n"


def test_benchmark_serve_against_the_server(server):
    """benchmarks/serve.py (the load generator, aiohttp) streams every request to its end and counts its tokens:
    the last line is its JSON report."""
    n, out_len = 6, 8
    cmd = [sys.executable, "-m", "benchmarks.serve", "--base-url", server.base_url, "--dataset", "random",
           "--random-input-len", "16", "--random-output-len", str(out_len), "--num-prompts", str(n),
           "--request-rate", "50", "--max-token-id", "200", "--temperature", "0"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["completed"], report["failed"]) == (n, 0), report["first_error"]
    assert report["output_tokens"] == n * out_len
    assert 0 < report["ttft_ms"]["p50"] and 0 < report["itl_ms"]["p50"]
