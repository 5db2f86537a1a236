"""The ``nanoserve`` console script, run as installed: ``serve [MODEL]`` (vLLM's shape, HTTP on --port) takes every
flag of launch.py from the same parser; ``chat`` and ``complete`` stream a running server's replies, as the openai
SDK gets them; ``bench`` runs the benchmarks, ``bench serve`` within the served model's vocabulary; ``chat``,
``complete`` and every ``--help`` start without torch; a server that cannot be reached is one line and exit 1."""

from __future__ import annotations

import json

import pytest

from nanoserve.serve_args import build_parser, parse_args
from settings import defaults
from tests.support.nanoserve_command import ServeProcess, imported_torch, nanoserve
from tests.support.processes import free_port
from tests.support.server import ENGINE_ARGS

NO_TORCH = {"PYTHONPROFILEIMPORTTIME": "1"}


@pytest.fixture(scope="module")
def served(tiny_tied, tmp_path_factory):
    """``nanoserve serve MODEL`` (positional, as ``vllm serve``) on a free HTTP port."""
    log = tmp_path_factory.mktemp("nanoserve") / "serve.log"
    server = ServeProcess(str(tiny_tied), "--port", "0", "--zmq-port", "0", *ENGINE_ARGS, log_path=log)
    yield server
    assert server.stop() == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def api(served):
    from openai import OpenAI

    return OpenAI(base_url=served.base_url, api_key="EMPTY")


@pytest.mark.parametrize(
    "args", [["--help"], ["serve", "--help"], ["chat", "--help"], ["complete", "--help"], ["bench", "--help"]]
)
def test_help_starts_without_torch(args):
    out = nanoserve(*args, env=NO_TORCH)
    assert out.returncode == 0 and out.stdout.startswith("usage: nanoserve"), out.stderr[-2000:]
    assert not imported_torch(out.stderr)


def test_version():
    out = nanoserve("--version")
    assert out.returncode == 0 and out.stdout.startswith("nanoserve 0."), out


def test_no_command_or_an_unknown_one_is_a_usage_error():
    for args in ([], ["srve"]):
        out = nanoserve(*args)
        assert out.returncode == 2 and "usage: nanoserve" in out.stderr and "error:" in out.stderr, out.stderr


def test_serve_takes_every_flag_of_launch_with_vllms_ports():
    launch, serve = build_parser("launch"), build_parser("serve")
    assert {a.dest for a in launch._actions} <= {a.dest for a in serve._actions}
    args = parse_args([], "serve")
    assert (args.http_port, args.port) == (defaults.HTTP_PORT, defaults.ZMQ_PORT) == (8000, 8765)
    args = parse_args(["some-org/tiny", "--port", "9001", "--zmq-port", "9002", "--tp", "2"], "serve")
    assert (args.model, args.http_port, args.port, args.tensor_parallel_size) == ("some-org/tiny", 9001, 9002, 2)
    assert parse_args(["--http-port", "9003"], "serve").http_port == 9003
    assert parse_args([]).http_port is None  # launch.py: HTTP only when asked


@pytest.mark.parametrize(
    "args, refusal",
    [
        (["a/b", "--model", "c/d"], "MODEL 'a/b' and --model 'c/d' name different models: give one"),
        (["--port", "9000", "--zmq-port", "9000"], "argument --port: 9000 clashes with --zmq-port 9000"),
    ],
)
def test_serve_refuses_contradictions_in_one_line(args, refusal):
    out = nanoserve("serve", *args, env=NO_TORCH)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    last = [line for line in out.stderr.splitlines() if not line.startswith("import time:")][-1]
    assert last.startswith(f"nanoserve serve: error: {refusal}"), out.stderr
    assert not imported_torch(out.stderr)


def test_complete_prints_what_the_sdk_gets(served, api):
    model = api.models.list().data[0].id
    want = api.completions.create(model=model, prompt="def fib(n):", max_tokens=12, temperature=0).choices[0].text
    out = nanoserve("complete", "--url", served.base_url, "--max-tokens", "12", "--temperature", "0", "def", "fib(n):")
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    quick = nanoserve("complete", "--url", served.base_url, "--max-tokens", "12", "--temperature", "0", "-q", "x")
    assert (
        quick.returncode == 0
        and quick.stdout
        == api.completions.create(model=model, prompt="x", max_tokens=12, temperature=0).choices[0].text + "\n"
    )


def test_chat_keeps_the_conversation(served, api):
    model = api.models.list().data[0].id
    messages, want = [{"role": "system", "content": "be brief"}], []
    for text in ("hello", "and again"):
        messages.append({"role": "user", "content": text})
        reply = api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        want.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": want[-1]})
    out = nanoserve(
        "chat", "--url", served.base_url, "--max-tokens", "8", "--temperature", "0", "--system-prompt", "be brief",
        stdin="hello\n\nand again\n",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == "".join(w + "\n" for w in want)


def test_a_refused_request_is_one_line(served):
    out = nanoserve("chat", "--url", served.base_url, "--model", "no-such-model", "-q", "hi")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == (
        f"error: {served.base_url}/chat/completions: HTTP 404: The model `no-such-model` does not exist."
    )


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_no_server_is_one_line_and_exit_1_without_torch(command):
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = nanoserve(command, "--url", url, "-q", "hi", env=NO_TORCH)
    assert out.returncode == 1 and out.stdout == ""
    errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert (
        len(errors) == 1 and errors[0].startswith(f"error: cannot reach {url} (") and "Connection refused" in errors[0]
    )
    assert not imported_torch(out.stderr)


def test_bench_serve_stays_in_the_models_vocabulary(served, tiny_tied):
    """W1's prompt ids go up to 10,000; the tiny model knows 512: without --max-token-id the benchmark asks the
    server which ids it knows, and every request completes."""
    vocab = json.loads((tiny_tied / "config.json").read_text())["vocab_size"]
    out = nanoserve("bench", "serve", "--base-url", served.base_url, "--num-prompts", "3", "--scale", "32")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"prompt ids    0..{vocab - 1} (the server's vocabulary" in out.stdout
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (report["completed"], report["failed"]) == (3, 0), report["first_error"]


def test_bench_throughput_runs_the_benchmark(tmp_path):
    out = nanoserve("bench", "throughput", "--check-floors", cwd=tmp_path)  # from anywhere, not just the checkout
    assert out.returncode == 0, out.stderr[-2000:]
    assert "check_floors" in json.loads(out.stdout.strip().splitlines()[-1])
    usage = nanoserve("bench", "throughput", "--help", cwd=tmp_path)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: nanoserve bench throughput")
