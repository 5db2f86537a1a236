"""logit_bias (completions and chat), vLLM's prompt_logprobs (completions and chat, through ``extra_body``), echo
with logprobs and structured outputs (OpenAI's response_format, vLLM's guided_choice) over HTTP: ``python launch.py
--http-port 0`` in a subprocess driven by the real ``openai`` SDK, HF transformers on the same float32 checkpoint
as the oracle; and the 400s that name the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serving.test_openai_server import GREEDY, NAME, api, hf, model_dir, server  # noqa: F401 (fixtures)
from tests.support.openai_http import http_post


def _hf_dist(oracle, ids: list[int]):
    """[len(ids), vocab] float64 log-softmax of HF's teacher-forced logits (row q predicts ids[q + 1])."""
    import torch

    with torch.no_grad():
        return oracle.model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def test_logit_bias_steers_completions_and_chat(api, hf):  # noqa: F811
    prompt = "def hello("
    ids = hf.ids(prompt)
    last = _hf_dist(hf, ids)[-1]
    best, second = last.topk(2).indices.tolist()
    chosen = int(last.argmin())
    r = api.completions.create(model=NAME, prompt=prompt, max_tokens=5, logit_bias={str(chosen): 100}, **GREEDY)
    assert r.choices[0].text == hf.text([chosen] * 5)
    # -100 on HF's greedy token: the first token is HF's second best; the logprobs stay the raw ones
    r = api.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, logprobs=1, logit_bias={str(best): -100}, **GREEDY
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [hf.tok.decode([second])]
    assert lp.token_logprobs[0] == pytest.approx(last[second].item(), abs=1e-4)
    # the same request without a bias: HF's greedy output
    plain = api.completions.create(model=NAME, prompt=prompt, max_tokens=5, **GREEDY)
    assert plain.choices[0].text == hf.text(hf.greedy(ids, 5))
    messages = [{"role": "user", "content": "Hello there!"}]
    cids = hf.chat_ids(messages)
    chat_chosen = int(_hf_dist(hf, cids)[-1].argmin())
    r = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=4, logit_bias={str(chat_chosen): 100}, **GREEDY
    )
    assert r.choices[0].message.content == hf.text([chat_chosen] * 4)


def _check_prompt_logprobs(pl: list, ids: list[int], dist, n: int, oracle) -> None:
    """vLLM's prompt_logprobs JSON against HF: None first, then per position the prompt token (its raw logprob,
    rank and text) followed by the top n, ranked 1..n."""
    assert len(pl) == len(ids) and pl[0] is None
    for p in range(1, len(ids)):
        d, token = pl[p], ids[p]
        top_values, top_ids = (t.tolist() for t in dist[p - 1].topk(n))
        assert list(d)[0] == str(token)  # JSON keys are strings; the prompt token first
        assert d[str(token)]["logprob"] == pytest.approx(dist[p - 1, token].item(), abs=1e-4)
        assert d[str(token)]["rank"] == int((dist[p - 1] >= dist[p - 1, token]).sum())
        assert d[str(token)]["decoded_token"] == oracle.tok.decode([token])
        for rank, (tid, value) in enumerate(zip(top_ids, top_values), 1):
            assert d[str(tid)]["rank"] == rank and d[str(tid)]["logprob"] == pytest.approx(value, abs=1e-4)
        assert len(d) == n + (token not in top_ids)


def test_prompt_logprobs_equal_hf(api, hf):  # noqa: F811
    ids = [5, 17, 300, 42, 7, 99, 250, 3, 480]
    n = 2
    extra = dict(GREEDY["extra_body"], prompt_logprobs=n)
    r = api.completions.create(model=NAME, prompt=ids, max_tokens=3, n=2, temperature=0, extra_body=extra)
    dist = _hf_dist(hf, ids)
    for choice in r.choices:  # every choice carries them, as vLLM's
        _check_prompt_logprobs(choice.prompt_logprobs, ids, dist, n, hf)
    plain = api.completions.create(model=NAME, prompt=ids, max_tokens=1, **GREEDY)
    assert "prompt_logprobs" not in plain.choices[0].model_dump()  # only when asked


def test_chat_prompt_logprobs_equal_hf(api, hf):  # noqa: F811
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there!"}]
    ids = hf.chat_ids(messages)
    extra = dict(GREEDY["extra_body"], prompt_logprobs=3)
    r = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=4, n=2, logprobs=True, temperature=0, extra_body=extra
    )
    _check_prompt_logprobs(r.prompt_logprobs, ids, _hf_dist(hf, ids), 3, hf)  # once, at the top level
    assert r.usage.prompt_tokens == len(ids)
    out = hf.greedy(ids, 4)
    expected = hf.logprobs(ids, out)
    for choice in r.choices:  # the choices are untouched by it
        assert choice.message.content == hf.text(out)
        lps = [e.logprob for e in choice.logprobs.content]
        assert lps == pytest.approx([expected[k, t].item() for k, t in enumerate(out)], abs=1e-4)
        assert "prompt_logprobs" not in choice.model_dump()
    extra = dict(GREEDY["extra_body"], prompt_logprobs=0)  # the prompt token alone
    r = api.chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0, extra_body=extra)
    _check_prompt_logprobs(r.prompt_logprobs, ids, _hf_dist(hf, ids), 0, hf)
    plain = api.chat.completions.create(model=NAME, messages=messages, max_tokens=1, **GREEDY)
    assert "prompt_logprobs" not in plain.model_dump()  # only when asked
    with pytest.raises(openai.BadRequestError, match="stream") as e:
        api.chat.completions.create(model=NAME, messages=messages, max_tokens=1, stream=True, extra_body=extra)
    assert e.value.body["param"] == "prompt_logprobs"


def _check_echo_logprobs(oracle, choice, prompt: str | list[int], max_tokens: int, n: int) -> None:
    """An echoed choice's logprobs against HF: the prompt tokens (the first with nulls) then the greedy output,
    each token with its raw logprob and its top n (named by text, the token itself first); the tokens and
    offsets line up with the choice's text."""
    ids = oracle.ids(prompt)
    out = oracle.greedy(ids, max_tokens) if max_tokens else []
    echoed = prompt if isinstance(prompt, str) else oracle.tok.decode(ids)
    assert choice.text == echoed + oracle.text(out)
    lp = choice.logprobs
    everything = ids + out
    assert lp.tokens == [oracle.tok.decode([t]) for t in everything]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    dist = _hf_dist(oracle, everything)
    for k in range(1, len(everything)):
        token, row = everything[k], dist[k - 1]
        expected = {oracle.tok.decode([token]): row[token].item()}
        expected.update({oracle.tok.decode([t]): row[t].item() for t in row.topk(n).indices.tolist()} if n else {})
        assert lp.token_logprobs[k] == pytest.approx(row[token].item(), abs=1e-4), k
        assert list(lp.top_logprobs[k]) == list(expected), k  # the token first, then the top n in order
        assert list(lp.top_logprobs[k].values()) == pytest.approx(list(expected.values()), abs=1e-4), k
    # the prompt's offsets run over its tokens' texts, the output's from where the echoed prompt ends
    starts = [sum(map(len, lp.tokens[:k])) for k in range(len(ids))]
    starts += [len(echoed) + sum(map(len, lp.tokens[len(ids) : k])) for k in range(len(ids), len(everything))]
    assert lp.text_offset == starts
    if isinstance(prompt, str):  # an ASCII prompt: every token's text is its own piece of the choice's text
        assert "".join(lp.tokens) == choice.text
        assert [choice.text[o : o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


def test_echo_with_logprobs_equals_hf(api, hf):  # noqa: F811
    prompts = ["the quick brown fox", "def hello("]
    r = api.completions.create(model=NAME, prompt=prompts, max_tokens=4, n=2, echo=True, logprobs=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, choice in enumerate(r.choices):  # choice i is prompt i // n's
        _check_echo_logprobs(hf, choice, prompts[i // 2], 4, 2)
        assert "prompt_logprobs" not in choice.model_dump()  # not asked for: only inside logprobs
    assert r.usage.prompt_tokens == sum(len(hf.ids(p)) for p in prompts) and r.usage.completion_tokens == 16
    ids = [5, 17, 300, 42, 7, 99]
    r = api.completions.create(model=NAME, prompt=ids, max_tokens=3, echo=True, logprobs=0, **GREEDY)
    _check_echo_logprobs(hf, r.choices[0], ids, 3, 0)  # the tokens alone
    # with prompt_logprobs too: each shows its own top N of the same computation
    extra = dict(GREEDY["extra_body"], prompt_logprobs=1)
    r = api.completions.create(
        model=NAME, prompt=prompts[0], max_tokens=2, echo=True, logprobs=3, temperature=0, extra_body=extra
    )
    _check_echo_logprobs(hf, r.choices[0], prompts[0], 2, 3)
    pids = hf.ids(prompts[0])
    _check_prompt_logprobs(r.choices[0].prompt_logprobs, pids, _hf_dist(hf, pids), 1, hf)
    extra = dict(GREEDY["extra_body"], prompt_logprobs=4)
    r = api.completions.create(
        model=NAME, prompt=prompts[1], max_tokens=2, echo=True, logprobs=1, temperature=0, extra_body=extra
    )
    _check_echo_logprobs(hf, r.choices[0], prompts[1], 2, 1)
    pids = hf.ids(prompts[1])
    _check_prompt_logprobs(r.choices[0].prompt_logprobs, pids, _hf_dist(hf, pids), 4, hf)
    # max_tokens=0 with echo (vLLM's way to score a prompt): the prompt and its logprobs, nothing generated
    r = api.completions.create(model=NAME, prompt=prompts[0], max_tokens=0, echo=True, logprobs=2, **GREEDY)
    _check_echo_logprobs(hf, r.choices[0], prompts[0], 0, 2)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (0, "length")
    chunks = api.completions.create(model=NAME, prompt=prompts[0], max_tokens=0, echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompts[0]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # without echo there is nothing to return
        api.completions.create(model=NAME, prompt=prompts[0], max_tokens=0, **GREEDY)
    # echo without logprobs is unchanged; echo with logprobs cannot stream (the prompt's come at the end)
    r = api.completions.create(model=NAME, prompt=prompts[1], max_tokens=2, echo=True, **GREEDY)
    assert r.choices[0].logprobs is None and r.choices[0].text.startswith(prompts[1])
    with pytest.raises(openai.BadRequestError, match="stream") as e:
        api.completions.create(model=NAME, prompt="x", max_tokens=2, echo=True, logprobs=1, stream=True)
    assert e.value.body["param"] == "echo"


def _error(resp: httpx.Response, param: str) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_bad_logit_bias_and_prompt_logprobs_are_400s_naming_the_field(api, server, hf):  # noqa: F811
    with pytest.raises(openai.BadRequestError, match=r"\[-100, 100\]") as e:
        api.completions.create(model=NAME, prompt="x", max_tokens=2, logit_bias={"5": 101})
    assert e.value.body["param"] == "logit_bias"
    url, chat = server.base_url + "/completions", server.base_url + "/chat/completions"
    messages = [{"role": "user", "content": "x"}]
    body = {"messages": messages, "logit_bias": {"5": -100.5}}
    assert "[-100, 100]" in _error(http_post(chat, json=body), "logit_bias")
    assert "token ids" in _error(http_post(url, json={"prompt": "x", "logit_bias": {"five": 1}}), "logit_bias")
    assert "token ids" in _error(http_post(url, json={"prompt": "x", "logit_bias": {"-3": 1}}), "logit_bias")
    assert "vocabulary" in _error(http_post(url, json={"prompt": "x", "logit_bias": {"99999": 1}}), "logit_bias")
    body = {"prompt": "x", "prompt_logprobs": 21}
    assert "prompt_logprobs" in _error(http_post(url, json=body), "prompt_logprobs")
    body = {"prompt": "x", "prompt_logprobs": 1, "stream": True}
    assert "stream" in _error(http_post(url, json=body), "prompt_logprobs")
    # and the server keeps serving
    r = api.completions.create(model=NAME, prompt="x", max_tokens=2, logit_bias={"5": 100}, **GREEDY)
    assert r.choices[0].text == hf.text([5, 5])


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_structured_outputs_follow_the_schema_and_choices(api):  # noqa: F811
    messages = [{"role": "user", "content": "Plan a trip"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    kw = dict(model=NAME, messages=messages, max_tokens=60, temperature=0, response_format=fmt)
    r = api.chat.completions.create(**kw)
    value = json.loads(r.choices[0].message.content)
    assert value["city"] in ("Paris", "Rome") and 1 <= value["days"] <= 9 and len(value) == 2
    assert r.choices[0].finish_reason == "stop"
    chunks = list(api.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    picks = api.completions.create(
        model=NAME, prompt="def hello(", max_tokens=20, n=4, temperature=1.0, seed=4,
        extra_body={"guided_choice": ["alpha", "beta gamma"]},
    )  # fmt: skip
    assert {c.text for c in picks.choices} <= {"alpha", "beta gamma"}
    with pytest.raises(openai.BadRequestError) as e:  # the coordinator compiles it, and names its own field
        api.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body={"guided_regex": "(a"})
    assert e.value.body["param"] == "structured_outputs" and "does not compile" in e.value.body["message"]
