"""logit_bias (completions and chat) and vLLM's prompt_logprobs (completions, through ``extra_body``) over HTTP:
``python launch.py --http-port 0`` in a subprocess driven by the real ``openai`` SDK, HF transformers on the same
float32 checkpoint as the oracle; and the 400s that name the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.test_openai_server import GREEDY, NAME, api, hf, model_dir, server  # noqa: F401 (fixtures)


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


def test_prompt_logprobs_equal_hf(api, hf):  # noqa: F811
    ids = [5, 17, 300, 42, 7, 99, 250, 3, 480]
    n = 2
    extra = dict(GREEDY["extra_body"], prompt_logprobs=n)
    r = api.completions.create(model=NAME, prompt=ids, max_tokens=3, n=2, temperature=0, extra_body=extra)
    dist = _hf_dist(hf, ids)
    for choice in r.choices:  # every choice carries them, as vLLM's
        pl = choice.prompt_logprobs
        assert len(pl) == len(ids) and pl[0] is None
        for p in range(1, len(ids)):
            d, token = pl[p], ids[p]
            top_values, top_ids = (t.tolist() for t in dist[p - 1].topk(n))
            assert list(d)[0] == str(token)  # JSON keys are strings; the prompt token first
            assert d[str(token)]["logprob"] == pytest.approx(dist[p - 1, token].item(), abs=1e-4)
            assert d[str(token)]["rank"] == int((dist[p - 1] >= dist[p - 1, token]).sum())
            assert d[str(token)]["decoded_token"] == hf.tok.decode([token])
            for rank, (tid, value) in enumerate(zip(top_ids, top_values), 1):
                assert d[str(tid)]["rank"] == rank and d[str(tid)]["logprob"] == pytest.approx(value, abs=1e-4)
            assert len(d) == n + (token not in top_ids)
    plain = api.completions.create(model=NAME, prompt=ids, max_tokens=1, **GREEDY)
    assert "prompt_logprobs" not in plain.choices[0].model_dump()  # only when asked


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
    assert "[-100, 100]" in _error(httpx.post(chat, json=body), "logit_bias")
    assert "token ids" in _error(httpx.post(url, json={"prompt": "x", "logit_bias": {"five": 1}}), "logit_bias")
    assert "token ids" in _error(httpx.post(url, json={"prompt": "x", "logit_bias": {"-3": 1}}), "logit_bias")
    assert "vocabulary" in _error(httpx.post(url, json={"prompt": "x", "logit_bias": {"99999": 1}}), "logit_bias")
    body = {"prompt": "x", "prompt_logprobs": 21}
    assert "prompt_logprobs" in _error(httpx.post(url, json=body), "prompt_logprobs")
    body = {"prompt": "x", "prompt_logprobs": 1, "stream": True}
    assert "stream" in _error(httpx.post(url, json=body), "prompt_logprobs")
    # and the server keeps serving
    r = api.completions.create(model=NAME, prompt="x", max_tokens=2, logit_bias={"5": 100}, **GREEDY)
    assert r.choices[0].text == hf.text([5, 5])
