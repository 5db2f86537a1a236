"""vLLM's allowed_token_ids over both remote front-ends of one ``python launch.py --http-port 0`` server: the real
``openai`` SDK (``extra_body``, completions and chat) and ``client.Client`` over ZMQ. HF transformers restricted to
the same ids (``prefix_allowed_tokens_fn``) is the oracle of greedy output; sampled output never leaves the set;
bad values are 400s (HTTP) or RequestErrors (ZMQ, also from a client that skipped validation) naming the field,
and the server keeps serving."""

from __future__ import annotations

import openai
import pytest
import torch

from client import Client
from protocol.errors import RequestError
from protocol.sampling_params import SamplingParams
from tests.serving.test_openai_server import GREEDY, NAME, api, hf, model_dir, server  # noqa: F401 (fixtures)
from tests.support.openai_http import http_post
from tests.support.timeouts import HANG_S

ALLOWED = [5, 17, 42, 99, 300]


@torch.no_grad()
def restricted_greedy(oracle, ids: list[int], allowed: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = oracle.model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
        prefix_allowed_tokens_fn=lambda batch_id, prefix: allowed,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_completions_and_chat_take_allowed_token_ids_in_extra_body(api, hf):  # noqa: F811
    prompt = "def hello("
    ids = hf.ids(prompt)
    expected = restricted_greedy(hf, ids, ALLOWED, 6)
    assert expected != hf.greedy(ids, 6)  # the restriction changes the output
    extra = dict(GREEDY["extra_body"], allowed_token_ids=ALLOWED)
    r = api.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
    assert r.choices[0].text == hf.text(expected)
    messages = [{"role": "user", "content": "Hello there!"}]
    expected = restricted_greedy(hf, hf.chat_ids(messages), ALLOWED, 5)
    r = api.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == hf.text(expected)
    # sampled: every token (as logprobs name them) is one of the allowed ids'
    r = api.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, n=3, temperature=1.5, seed=3, logprobs=0, extra_body=extra
    )
    texts = {hf.tok.decode([t]) for t in ALLOWED}
    for choice in r.choices:
        assert set(choice.logprobs.tokens) <= texts, choice.logprobs.tokens


def test_bad_allowed_token_ids_are_400s_naming_the_field(api, server, hf):  # noqa: F811
    url = server.base_url + "/completions"
    for bad, words in (([], "non-empty"), ([-1], "token ids"), ([4, 99999], "vocabulary"), ("5", "")):
        resp = http_post(url, json={"prompt": "x", "max_tokens": 2, "allowed_token_ids": bad})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "allowed_token_ids" and words in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], extra_body={"allowed_token_ids": []}
        )
    assert e.value.body["param"] == "allowed_token_ids"
    r = api.completions.create(
        model=NAME, prompt="x", max_tokens=2, temperature=0, extra_body={"allowed_token_ids": [7]}
    )
    assert r.choices[0].text == hf.text([7, 7])  # and the server keeps serving


def test_client_sends_allowed_token_ids_and_the_server_validates_them(server, hf):  # noqa: F811
    ids = hf.ids("the quick brown fox")
    with Client(server.zmq, timeout=HANG_S) as c:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=ALLOWED)
        assert c.generate(ids, params).token_ids == restricted_greedy(hf, ids, ALLOWED, 6)
        for bad, words in (([], "non-empty"), ([4, 99999], "vocabulary")):
            params = SamplingParams(temperature=0, max_tokens=2)
            params.allowed_token_ids = bad  # after construction: the server is the one to refuse it
            with pytest.raises(RequestError, match=f"allowed_token_ids.*{words}|{words}.*allowed_token_ids"):
                c.generate(ids, params)
        assert c.generate(ids, SamplingParams(temperature=0, max_tokens=2, allowed_token_ids=[9])).token_ids == [9, 9]
