"""The generation routes' short way (openai_server/json_routes.py: an ``application/json`` body parsed by pydantic
from its bytes) answers every body exactly as FastAPI's generic way does: the same body sent as
``application/json; profile=x`` (JSON to FastAPI, not to the short way) gets the same status and the same answer,
ids and times aside; a body that is not JSON to FastAPI (text/plain) is refused as before."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.openai_http import HttpServer
from tests.support.timeouts import HANG_S

SHORT = {"content-type": "application/json"}
GENERIC = {"content-type": "application/json; profile=x"}  # FastAPI's JSON too, but not the short way's


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    with HttpServer(tiny_tied, tmp_path_factory.mktemp("short_way") / "server.log") as srv:
        yield srv


def _answer(r: httpx.Response):
    """Status and body with what differs between two identical requests (ids, times) left out."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        body = [e if e == "[DONE]" else _same(json.loads(e)) for e in events]
    else:
        body = _same(r.json())
    return r.status_code, body


def _same(d):
    return {k: v for k, v in d.items() if k not in ("id", "created")} if isinstance(d, dict) else d


COMPLETION_BODIES = [
    b'{"prompt": "hello there", "max_tokens": 4, "temperature": 0}',
    b'{"prompt": [11, 12, 13], "max_tokens": 3, "temperature": 0, "stream": true}',
    b'{"prompt": "x", "max_tokens": 2, "temperature": 0, "n": "2", "unknown_field": [1, {"a": 2}]}',
    b'{"prompt": "x", "max_tokens": 1, "max_tokens": 3, "temperature": 0}',  # a repeated key: the last counts
    b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}',
    b'{"prompt": "x", "max_tokens": 2, "temperature": 1e400}',
    b'{"prompt": "x", "max_tokens": 2, "seed": 123456789012345678901234567890}',
    b'{"prompt": "x", "max_tokens": "many"}',
    b'{"prompt": 5}',
    b'{"prompt": [1, "a"]}',
    b'{"prompt": "x"} trailing',
    b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1, "temperature": 0}',  # a byte-order mark
    b'{"prompt": "\xff\xfe", "max_tokens": 1}',  # not UTF-8
    b'{"prompt": "a\\ud800", "max_tokens": 1}',  # a lone surrogate
    b"[]",
    b"null",
]
CHAT_BODIES = [
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": true}',
    b'{"messages": [], "max_tokens": 3}',
    b'{"messages": [{"content": "no role"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2, '
    b'"temperature": 0, "top_logprobs": 2}',
]


@pytest.mark.parametrize("path, bodies", [("/completions", COMPLETION_BODIES), ("/chat/completions", CHAT_BODIES)])
def test_the_short_way_answers_as_fastapis(server, path, bodies):
    url = server.base_url + path
    with httpx.Client(timeout=HANG_S) as client:
        for body in bodies:
            short = _answer(client.post(url, content=body, headers=SHORT))
            generic = _answer(client.post(url, content=body, headers=GENERIC))
            assert short == generic, body


def test_a_body_that_is_not_json_to_fastapi_is_still_refused(server):
    body = b'{"prompt": "x", "max_tokens": 1}'
    r = httpx.post(
        server.base_url + "/completions", content=body, headers={"content-type": "text/plain"}, timeout=HANG_S
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
