"""What the HTTP front-end admits, checked before it spends memory or time on a body: the API key before a byte of the
body is read, a body over the coordinator's --max-message-bytes refused with 413 unread (from its Content-Length,
or as a chunked body crosses the limit), the front-end's RSS back where it was after a flood of oversized bodies
and of large allowed ones, and integers out of the wire's signed 64-bit range refused with a 400 naming the field
(they once reached msgpack, which cannot pack them: a 500 with nothing logged)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.support.openai_http import HttpServer
from tests.support.processes import children_of

KEY = "admission-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
LIMIT = 8 << 20  # the coordinator's default --max-message-bytes, which the front-end takes as its body limit
ANSWER_S = 60  # generous: a refusal needs no work, but the box may be busy


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    with HttpServer(tiny_tied, tmp_path_factory.mktemp("admission") / "server.log", "--api-key", KEY) as srv:
        srv.host, srv.port = httpx.URL(srv.root).host, httpx.URL(srv.root).port
        yield srv


def _front_end(server) -> int:
    (pid,) = [p for p in children_of(server.proc.pid) if b"openai_server" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _settled_rss_mib(pid: int, at_most: float, wait_s: float = 30) -> float:
    """Its RSS once at most ``at_most`` MiB, or the last seen at ``wait_s``: the front-end frees a large request's
    memory right after answering it, as the client already reads the answer."""
    deadline = time.monotonic() + wait_s
    while (rss := _rss_mib(pid)) > at_most and time.monotonic() < deadline:
        time.sleep(0.2)
    return rss


def _head(path: str, headers: dict) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status_and_body(sock: socket.socket) -> tuple[int, bytes]:
    """The response read until the server closes (or its Content-Length is complete)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        length = [int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")]
        if sep and length and len(body) >= length[0]:
            break
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split()[1]), data.partition(b"\r\n\r\n")[2]


def _declared(server, length: int, headers: dict, path: str = "/v1/completions") -> tuple[int, bytes]:
    """Headers promising ``length`` bytes of body, and no body at all: only a server that answers before reading
    it answers (else this waits for it until ANSWER_S)."""
    with socket.create_connection((server.host, server.port), timeout=ANSWER_S) as sock:
        sock.sendall(_head(path, {**headers, "Content-Length": str(length)}))
        return _status_and_body(sock)


def _chunked(server, total: int, headers: dict, chunk: int = 1 << 20) -> tuple[int, bytes]:
    """A chunked body of ``total`` bytes of JSON text, sent until the server answers or stops reading."""
    with socket.create_connection((server.host, server.port), timeout=ANSWER_S) as sock:
        sock.sendall(_head("/v1/completions", {**headers, "Transfer-Encoding": "chunked"}))
        payload = b'{"prompt": "' + b"a" * (total - 14) + b'"}'
        try:
            for i in range(0, len(payload), chunk):
                part = payload[i : i + chunk]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: the response is waiting in our receive buffer
        return _status_and_body(sock)


def _error(status: int, body: bytes, expected: int) -> dict:
    assert status == expected, body[:300]
    return httpx.Response(status, content=body).json()["error"]


def test_the_key_is_checked_before_the_body_is_read(server):
    err = _error(*_declared(server, 50 << 20, {}), 401)
    assert err["type"] == "AuthenticationError" and err["code"] == 401
    _error(*_declared(server, 1000, {"Authorization": "Bearer wrong"}), 401)
    _error(*_declared(server, 1000, {}, "/tokenize"), 401)
    assert httpx.get(server.root + "/health", timeout=ANSWER_S).status_code == 200  # probes need no key
    assert httpx.get(server.root + "/v1/models", timeout=ANSWER_S).status_code == 401
    assert httpx.get(server.root + "/v1/models", headers=HEADERS, timeout=ANSWER_S).status_code == 200


def test_a_body_over_the_message_limit_is_413_unread(server):
    for length in (LIMIT + 1, 50 << 20):  # the limit is the coordinator's, not a multiple of it
        err = _error(*_declared(server, length, HEADERS), 413)
        assert str(LIMIT) in err["message"] and err["type"] == "RequestTooLargeError"
    err = _error(*_chunked(server, 50 << 20, HEADERS), 413)  # refused as it crosses the limit
    assert str(LIMIT) in err["message"]
    # a body at the limit is read and parsed: here a prompt too long for the model, a 400 naming it
    at_limit = {"prompt": "a" * (LIMIT - 60), "max_tokens": 2}
    r = httpx.post(server.base_url + "/completions", json=at_limit, headers=HEADERS, timeout=ANSWER_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2}, headers=HEADERS)
    assert r.status_code == 200, r.text


def _ids_body(size: int) -> bytes:
    """A completions body of about ``size`` bytes whose prompt is token ids (the dearest JSON to parse and check)."""
    count = (size - 40) // 4
    return b'{"max_tokens": 2, "prompt": [' + b",".join([b"123"] * count) + b"]}"


def test_memory_after_floods_of_large_bodies_is_where_it_was(server, capsys):
    pid = _front_end(server)
    with httpx.Client(headers=HEADERS, timeout=ANSWER_S) as client:
        for _ in range(3):  # warm: the routes' first use, imports, caches
            assert client.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2}).is_success
    before = _rss_mib(pid)
    for _ in range(20):  # 20 x 50 MB: declared (refused from the header) and chunked (refused at the limit)
        _error(*_declared(server, 50 << 20, HEADERS), 413)
        _error(*_chunked(server, 50 << 20, HEADERS), 413)
        _error(*_declared(server, 50 << 20, {}), 401)
    after_oversized = _settled_rss_mib(pid, before * 1.10)
    body = _ids_body(LIMIT - 1024)  # allowed: parsed, checked, sent, refused by the coordinator for its length
    with httpx.Client(headers={**HEADERS, "content-type": "application/json"}, timeout=ANSWER_S) as client:
        peak = 0.0
        for _ in range(5):
            r = client.post(server.base_url + "/completions", content=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
            peak = max(peak, _rss_mib(pid))
    after_allowed = _settled_rss_mib(pid, before * 1.10)
    with capsys.disabled():
        print(
            f"\nfront-end RSS: {before:.0f} MiB before, {after_oversized:.0f} MiB after 20 x (50 MB declared + 50 MB "
            f"chunked + 50 MB unauthenticated), {after_allowed:.0f} MiB after 5 x {len(body) >> 20} MiB allowed "
            f"bodies (peak seen {peak:.0f} MiB)"
        )
    assert after_oversized <= before * 1.10
    assert after_allowed <= before * 1.10


BIG = [2**63, 2**64, 10**30]  # over the wire's signed 64-bit range; msgpack packs nothing from 2**64


@pytest.mark.parametrize("value", BIG, ids=["2^63", "2^64", "10^30"])
def test_integers_out_of_the_wires_range_are_400s_naming_the_field(server, value):
    completions, chat = server.base_url + "/completions", server.base_url + "/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (completions, {"prompt": "x", "max_tokens": value}, "max_tokens"),
        (completions, {"prompt": [1, value], "max_tokens": 2}, "prompt"),
        (completions, {"prompt": [[1, 2], [3, value]], "max_tokens": 2}, "prompt"),
        (completions, {"prompt": "x", "max_tokens": 2, "stop_token_ids": [value]}, "stop_token_ids"),
        (completions, {"prompt": "x", "max_tokens": 2, "logit_bias": {str(value): 1}}, "logit_bias"),
        (completions, {"prompt": "x", "max_tokens": 2, "seed": value}, "seed"),
        (completions, {"prompt": "x", "max_tokens": 2, "seed": -value - 1}, "seed"),
        (completions, {"prompt": "x", "max_tokens": 2, "n": value}, "n"),
        (completions, {"prompt": "x", "max_tokens": 2, "top_k": value}, "top_k"),
        (completions, {"prompt": "x", "max_tokens": 2, "min_tokens": value}, "min_tokens"),
        (completions, {"prompt": "x", "max_tokens": 2, "logprobs": value}, "logprobs"),
        (completions, {"prompt": "x", "max_tokens": 2, "prompt_logprobs": value}, "prompt_logprobs"),
        (completions, {"prompt": "x", "max_tokens": 2, "truncate_prompt_tokens": value}, "truncate_prompt_tokens"),
        (completions, {"prompt": "x", "max_tokens": 2, "stream": True, "seed": value}, "seed"),
        (chat, {"messages": messages, "max_tokens": value}, "max_tokens"),
        (chat, {"messages": messages, "max_completion_tokens": value}, "max_completion_tokens"),
        (chat, {"messages": messages, "max_tokens": 2, "stop_token_ids": [value]}, "stop_token_ids"),
        (chat, {"messages": messages, "max_tokens": 2, "logprobs": True, "top_logprobs": value}, "top_logprobs"),
        (server.root + "/detokenize", {"tokens": [1, value]}, "tokens"),
    ]
    with httpx.Client(headers=HEADERS, timeout=ANSWER_S) as client:
        for url, body, param in cases:
            r = client.post(url, json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            named = "max_tokens" if param == "max_completion_tokens" else param  # SamplingParams names it so
            assert err["param"] == param and named in err["message"], (body, err)
        assert client.post(completions, json={"prompt": [1, 2**63 - 1], "max_tokens": 2}).status_code == 400
        assert client.post(completions, json={"prompt": "x", "max_tokens": 2, "seed": 2**63 - 1}).is_success
    assert "Traceback" not in server.stderr()


def test_a_long_conversation_is_checked_and_refused_by_its_length(server):
    """Thousands of messages are flattened in a worker thread (the event loop runs meanwhile): the request still
    gets its answer, here a 400 naming messages, as the conversation is far over the model's context."""
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}"} for i in range(3000)]
    r = httpx.post(
        server.base_url + "/chat/completions", json={"messages": messages}, headers=HEADERS, timeout=ANSWER_S
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    messages[7]["content"] = "\ud800"  # a lone surrogate, as JSON escapes it: still found among thousands
    body = json.dumps({"messages": messages}).encode()
    headers = {**HEADERS, "content-type": "application/json"}
    r = httpx.post(server.base_url + "/chat/completions", content=body, headers=headers, timeout=ANSWER_S)
    assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"], r.text[:300]
