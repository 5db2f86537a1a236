"""The ``nanoserve`` command (pyproject's console script), in ``vllm``'s shape:

    nanoserve serve [MODEL] [flags]      serve over HTTP on port 8000 (and ZMQ on 8765); every flag of launch.py
    nanoserve chat [--url URL] [-q MSG]  chat with a running server (stdin, one message a line)
    nanoserve complete [PROMPT]          complete a prompt (none: one a line from stdin)
    nanoserve bench throughput|serve     run benchmarks/throughput.py or benchmarks/serve.py (from a checkout)

Each subcommand loads only what it needs: ``chat``, ``complete`` and every ``--help`` start without torch."""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import sys
from pathlib import Path

COMMANDS = {
    "serve": "serve a model over HTTP (OpenAI-compatible, port 8000) and ZMQ; MODEL: a directory or a Hub id",
    "chat": "chat with a running server (--url, default http://localhost:8000/v1)",
    "complete": "complete prompts on a running server",
    "bench": "run a benchmark: throughput (offline engine) or serve (HTTP load on a running server)",
}
BENCHMARKS = {"throughput": "benchmarks.throughput", "serve": "benchmarks.serve"}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nanoserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nanoserve",
        description="nanoserve: a small, fast LLM inference runtime. `nanoserve COMMAND --help` describes each.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:10s} {text}" for name, text in COMMANDS.items()),
        allow_abbrev=False,
    )
    p.add_argument("-V", "--version", action="version", version=f"nanoserve {_version()}", help="print the version")
    p.add_argument("command", choices=list(COMMANDS), help="what to do (listed below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    return p


def _chat(argv: list[str], chat_mode: bool) -> int:
    from nanoserve import http_chat

    name = "chat" if chat_mode else "complete"
    p = argparse.ArgumentParser(prog=f"nanoserve {name}", description=COMMANDS[name] + ".", allow_abbrev=False)
    http_chat.add_flags(p, chat_mode)
    return http_chat.run(p.parse_args(argv), chat_mode)


def _bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanoserve bench", description=COMMANDS["bench"] + ".", allow_abbrev=False)
    p.add_argument("benchmark", choices=list(BENCHMARKS), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (`nanoserve bench NAME --help`)")
    args = p.parse_args(argv[:1])  # the benchmark's own flags (--help included) are its parser's
    module = BENCHMARKS[args.benchmark]
    if importlib.util.find_spec("benchmarks") is None:
        # an editable install maps only the runtime packages; the benchmarks live beside them in the checkout
        checkout = Path(__file__).resolve().parents[1]
        if not (checkout / "benchmarks" / "__init__.py").exists():
            print("error: nanoserve bench needs a source checkout (benchmarks/ is not installed)", file=sys.stderr)
            return 1
        sys.path.insert(0, str(checkout))
    sys.argv = [f"nanoserve bench {args.benchmark}", *argv[1:]]
    try:
        # as `python -m benchmarks.NAME` runs it; sys.argv[0] stays the name its usage line shows
        runpy.run_module(module, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return e.code or 0
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:  # --help, or a usage error naming the commands
        _top_parser().parse_args(argv)
        return 2  # unreachable unless argparse changes: a command was required
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from nanoserve.serve import main as serve

        return serve(rest, command="serve")
    if command == "bench":
        return _bench(rest)
    return _chat(rest, chat_mode=command == "chat")


if __name__ == "__main__":
    sys.exit(main())
