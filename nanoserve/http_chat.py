"""``nanoserve chat`` and ``nanoserve complete``: talk to a running OpenAI-compatible server (``nanoserve serve``,
``launch.py --http-port``, or any other), as ``vllm chat`` and ``vllm complete`` do. Standard library only (urllib),
so the command starts at once: no torch, no HTTP client package. Replies stream to stdout as they are generated."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

from settings import defaults
from settings.env import settings

DEFAULT_URL = f"http://localhost:{defaults.HTTP_PORT}/v1"


class ServerError(Exception):
    """The server cannot be reached, or it answered with an error: one line for the user."""


def add_flags(p: argparse.ArgumentParser, chat: bool) -> None:
    what = "message" if chat else "prompt"
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server's OpenAI base URL (default {DEFAULT_URL})")
    p.add_argument(
        "--model", "--model-name", dest="model", default=None, help="the model to ask (default: the server's first)"
    )
    p.add_argument("--api-key", default=settings().api_key, help="sent as a Bearer token (env NANOSERVE_API_KEY)")
    p.add_argument(
        "-q", "--quick", metavar=what.upper(), default=None, help=f"send this one {what}, print the reply, exit"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate at most (default: the server's)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server (default 600)")
    if chat:
        p.add_argument("--system-prompt", default=None, help="a system message that opens the conversation")
    else:
        p.add_argument("prompt", nargs="*", help="the prompt (several words are joined); none: read prompts from stdin")


class Api:
    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except Exception:  # not an OpenAI error body: the status says enough
                message = e.reason
            raise ServerError(f"{self.url}{path}: HTTP {e.code}: {message}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"cannot reach {self.url} ({reason}); is a server running (nanoserve serve)?") from None

    def first_model(self) -> str:
        with self._open("/models") as r:
            models = json.loads(r.read()).get("data") or []
        if not models:
            raise ServerError(f"{self.url}/models lists no model")
        return models[0]["id"]

    def stream(self, path: str, body: dict) -> Iterator[str]:
        """The text of each streamed chunk of a completion (``/completions``) or chat completion."""
        with self._open(path, {**body, "stream": True}) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ServerError(f"the server stopped the reply: {chunk['error'].get('message', chunk['error'])}")
                for choice in chunk.get("choices") or []:
                    yield choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _body(args: argparse.Namespace, model: str) -> dict:
    body: dict = {"model": model}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


def _print_stream(chunks: Iterator[str]) -> str:
    text = []
    for piece in chunks:
        sys.stdout.write(piece)
        sys.stdout.flush()
        text.append(piece)
    sys.stdout.write("\n")
    return "".join(text)


def _lines(prompt: str) -> Iterator[str]:
    """Lines typed at the terminal (or piped in), until end of input."""
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(prompt if interactive else "")
        except EOFError:
            return
        if line.strip():
            yield line


def chat(args: argparse.Namespace) -> int:
    api = Api(args.url, args.api_key, args.timeout)
    model = args.model or api.first_model()
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    turns = [args.quick] if args.quick is not None else _lines("> ")
    if args.quick is None and sys.stdin.isatty():
        print(f"chatting with {model} at {api.url} (Ctrl-D to end)", file=sys.stderr)
    for text in turns:
        messages.append({"role": "user", "content": text})
        reply = _print_stream(api.stream("/chat/completions", {**_body(args, model), "messages": messages}))
        messages.append({"role": "assistant", "content": reply})
    return 0


def complete(args: argparse.Namespace) -> int:
    api = Api(args.url, args.api_key, args.timeout)
    model = args.model or api.first_model()
    given = args.quick if args.quick is not None else " ".join(args.prompt)
    prompts = [given] if given else _lines("prompt> ")
    for prompt in prompts:
        _print_stream(api.stream("/completions", {**_body(args, model), "prompt": prompt}))
    return 0


def run(args: argparse.Namespace, chat_mode: bool) -> int:
    """The command's exit status: 0, 1 with one line for a server that cannot be reached or answered an error."""
    try:
        return chat(args) if chat_mode else complete(args)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
