"""The OpenAI-compatible HTTP server beyond generation: a disconnect aborts the request and frees its KV blocks
(streamed or not), the errors name the field and the server keeps serving, /tokenize and /detokenize, /v1/models,
/version, /health, /metrics (parsed by prometheus_client) and the log lines, the README's chat example, and
benchmarks/serve.py against the server. Same server as test_openai_server.py's (its fixtures)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.serving.test_openai_server import ALIAS, GREEDY, NAME, api, hf, model_dir, server  # noqa: F401 (fixtures)
from tests.support.openai_http import http_get, http_post, metric, metrics
from tests.support.processes import ROOT
from tests.support.timeouts import HANG_S, START_S


def test_disconnect_mid_stream_aborts_and_frees_kv(server):  # noqa: F811
    aborted = metric(server, "nanoserve:request_success_total", finished_reason="abort")
    generated = metric(server, "nanoserve:generation_tokens_total")
    prompt_sum = metric(server, "nanoserve:request_prompt_tokens_sum")
    body = {"model": NAME, "prompt": "once upon a time", "max_tokens": 480, "stream": True, "ignore_eos": True}
    prompt_len = http_post(server.root + "/tokenize", json={"model": NAME, "prompt": body["prompt"]}).json()["count"]
    with httpx.Client(timeout=HANG_S) as client:
        with client.stream("POST", server.base_url + "/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + HANG_S
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
    # the front-end never read the last Delta, yet its histogram and log line count the prompt
    assert metric(server, "nanoserve:request_prompt_tokens_sum") - prompt_sum == prompt_len > 0
    # a request that does not stream, its client gone once it runs: aborted and counted as one too
    host, port = server.root.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": False}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + HANG_S
        while not metric(server, "nanoserve:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.01)
    deadline = time.monotonic() + HANG_S
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


def test_errors_name_the_field_and_the_server_keeps_serving(api, server):  # noqa: F811
    url = server.base_url + "/completions"
    assert "temperature" in _error(http_post(url, json={"prompt": "x", "temperature": -1}), 400, "temperature")
    assert "max_tokens" in _error(http_post(url, json={"prompt": "x", "max_tokens": "many"}), 400, "max_tokens")
    assert "prompt" in _error(http_post(url, json={"prompt": ["a", [1]]}), 400, "prompt")
    assert "max_model_len" in _error(http_post(url, json={"prompt": "x", "max_tokens": 900}), 400, "max_tokens")
    assert "vocabulary" in _error(http_post(url, json={"prompt": [10**6]}), 400, "prompt")
    assert "n " in _error(http_post(url, json={"prompt": "x", "n": 0}), 400, "n")
    assert "model" in _error(http_post(url, json={"prompt": "x", "model": "gpt-9"}), 404, "model")
    _error(http_post(url, json={"prompt": "x", "guided_choice": []}), 400, "guided_choice")  # not ignored
    bad_regex = {"prompt": "x", "guided_regex": "(a"}  # compiled by the coordinator, which names its own field
    assert "does not compile" in _error(http_post(url, json=bad_regex), 400, "structured_outputs")
    _error(http_post(url, json={"prompt": "x", "stop": ""}), 400, "stop")  # as [""], not silently no stop
    only_streams = {"prompt": "x", "stream_options": {"include_usage": True}}
    assert "stream=true" in _error(http_post(url, json=only_streams), 400, "stream_options")
    chat = server.base_url + "/chat/completions"
    _error(http_post(chat, json={"messages": []}), 400, "messages")
    _error(
        http_post(chat, json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400, "top_logprobs"
    )
    both = {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}  # generation prompt on
    assert "cannot both be true" in _error(http_post(chat, json=both), 400, "continue_final_message")
    too_many = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}
    assert "top_logprobs must be in [0, 20]" in _error(http_post(chat, json=too_many), 400, "top_logprobs")
    not_json = http_post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert "not valid JSON" in _error(not_json, 400, None)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], top_p=0)
    # an unknown field is ignored (with a warning in the log), as vLLM does
    r = http_post(url, json={"prompt": "x", "max_tokens": 2, "no_such_field": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    assert "no_such_field" in server.stderr()


def test_tokenize_detokenize_models_version_health(server, hf):  # noqa: F811
    text = "Hello world, Ünïcödé"
    r = http_post(server.root + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == hf.tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert r["token_strs"] == hf.tok.convert_ids_to_tokens(r["tokens"])  # the vocabulary's spelling, as vLLM's
    assert r["token_strs"] != [hf.tok.decode([t]) for t in r["tokens"]]  # not each token's text
    messages = [{"role": "user", "content": "hi"}]
    r = http_post(server.root + "/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == hf.chat_ids(messages)
    r = http_post(server.root + "/detokenize", json={"tokens": hf.tok.encode(text)}).json()
    assert r["prompt"] == text
    special = "<|im_start|>user\nhi<|im_end|>"  # as vLLM's, special tokens are kept: the round trip holds
    ids = http_post(server.root + "/tokenize", json={"prompt": special}).json()["tokens"]
    assert http_post(server.root + "/detokenize", json={"tokens": ids}).json()["prompt"] == special
    assert "vocabulary" in _error(http_post(server.root + "/detokenize", json={"tokens": [99999]}), 400, "tokens")
    models = http_get(server.base_url + "/models").json()
    assert [m["id"] for m in models["data"]] == [NAME, ALIAS] and models["data"][0]["max_model_len"] == 512
    aliased = http_post(server.base_url + "/completions", json={"model": ALIAS, "prompt": "hi", "max_tokens": 2})
    assert aliased.status_code == 200 and aliased.json()["model"] == NAME  # vLLM's: the first served name
    cut = {"prompt": list(range(100, 140)), "max_tokens": 2, "truncate_prompt_tokens": 10}  # vLLM's extra
    assert http_post(server.base_url + "/completions", json=cut).json()["usage"]["prompt_tokens"] == 10
    # a conversation longer than max_model_len (512) fits once cut, max_tokens left to the room after the cut
    long_chat = {"messages": [{"role": "user", "content": "tok " * 700}], "truncate_prompt_tokens": 20}
    r = http_post(server.base_url + "/chat/completions", json=long_chat)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20, r.text
    assert time.time() - 3600 < models["data"][0]["created"] <= time.time()  # when the server started, as vLLM's
    assert http_get(server.root + "/version").json()["version"]
    assert http_get(server.root + "/health").status_code == 200


def test_metrics_names_parse_and_logs(server, api):  # noqa: F811
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
    # the periodic line (every second) reports an interval with work, measured against the sample before it, so
    # requests go on until it shows (the ones above may all have come before the server's first sample)
    deadline = time.monotonic() + HANG_S
    while "Avg generation throughput" not in server.stderr() and time.monotonic() < deadline:
        api.completions.create(model=NAME, prompt="metrics", max_tokens=4, stream=False, **GREEDY)
        time.sleep(0.3)
    log = server.stderr()
    assert re.search(r"cmpl-\w+ finished: \d+ prompt \+ 4 output tokens, [\d.]+ s, finish_reason=length", log)
    assert "Avg generation throughput" in log and "KV cache usage" in log


def test_readme_chat_example_runs(server, api):  # noqa: F811
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## OpenAI-compatible HTTP API") :]
    code = section[
        section.index("```python") + len("```python") : section.index("```\n", section.index("```python") + 9)
    ]
    assert "http://127.0.0.1:8000/v1" in code
    code = code.replace("http://127.0.0.1:8000/v1", server.base_url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=START_S)
    assert out.returncode == 0, out.stderr
    messages = [{"role": "user", "content": "Write a haiku about GPUs."}]
    same = api.chat.completions.create(model=NAME, messages=messages, max_tokens=64)  # greedy: top_k=1 default
    assert out.stdout == same.choices[0].message.content + "\n"


def test_benchmark_serve_against_the_server(server):  # noqa: F811
    """benchmarks/serve.py (the load generator, httpx) streams every request to its end and counts its tokens:
    the last line is its JSON report."""
    n, out_len = 6, 8
    cmd = [sys.executable, "-m", "benchmarks.serve", "--base-url", server.base_url, "--dataset", "random",
           "--random-input-len", "16", "--random-output-len", str(out_len), "--num-prompts", str(n),
           "--request-rate", "50", "--max-token-id", "200", "--temperature", "0"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=START_S)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["completed"], report["failed"]) == (n, 0), report["first_error"]
    assert report["output_tokens"] == n * out_len
    assert 0 < report["ttft_ms"]["p50"] and 0 < report["itl_ms"]["p50"]
    # the server's own histogram over these requests alone: inside each request's client-side interval
    assert 0 < report["server_ttft_mean_ms"] <= report["ttft_ms"]["mean"]
