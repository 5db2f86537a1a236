"""A chat request is prepared by the coordinator alone (coordinator/admission.py): the HTTP front-end neither cuts
the prompt nor counts the room an unset max_tokens takes, and maps the coordinator's refusals to 400s naming the
field. Served with and without a reasoning parser (which sends the conversation's token ids instead of the
conversation: the same preparation must follow). ``python launch.py --http-port 0`` in a subprocess, httpx."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.openai_http import HttpServer
from tests.support.timeouts import HANG_S

MAX_LEN = 512  # the test servers' --max-model-len
GEN_MAX_NEW_TOKENS = 20  # the generation config's max_new_tokens: the cap of an unset max_tokens
LONG = [{"role": "user", "content": "tok " * 700}]  # over MAX_LEN in tokens
BODY = {"messages": LONG, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "reasoning-parser"])
def server(request, tiny_tied, tmp_path_factory):
    gen = tmp_path_factory.mktemp("gen")
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": GEN_MAX_NEW_TOKENS}))
    flags = ["--generation-config", str(gen)]
    if request.param:
        flags += ["--reasoning-parser", "qwen3"]
    with HttpServer(tiny_tied, tmp_path_factory.mktemp("http") / "server.log", *flags) as srv:
        yield srv


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=HANG_S)


def _error_param(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def test_the_room_of_an_unset_max_tokens_is_counted_after_the_cut(server):
    r = _post(server, {**BODY, "truncate_prompt_tokens": 20})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 20, "completion_tokens": GEN_MAX_NEW_TOKENS, "total_tokens": 40}
    # 12 tokens of room, under the model's max_new_tokens: the room
    r = _post(server, {**BODY, "truncate_prompt_tokens": 500})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 500 and r.json()["usage"]["completion_tokens"] == MAX_LEN - 500
    assert r.json()["choices"][0]["finish_reason"] == "length"
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json={**BODY, "truncate_prompt_tokens": 500, "stream": True,
        "stream_options": {"include_usage": True}}, timeout=HANG_S,
    ) as resp:  # fmt: skip
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == MAX_LEN - 500


def test_the_coordinators_refusals_name_the_field(server):
    assert _error_param(_post(server, BODY)) == "messages"  # uncut, it fills the context
    assert _error_param(_post(server, {**BODY, "truncate_prompt_tokens": 500, "min_tokens": 15})) == "min_tokens"
    assert _error_param(_post(server, {**BODY, "truncate_prompt_tokens": 500, "max_tokens": 13})) == "max_tokens"
    r = _post(server, {**BODY, "truncate_prompt_tokens": 500, "max_tokens": 12})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
    assert "Traceback" not in server.stderr()
