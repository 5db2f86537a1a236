"""The output-parser flags (``--reasoning-parser``, ``--enable-auto-tool-choice``, ``--tool-call-parser``), which
``launch.py`` passes on to the front-end: one definition for both command lines."""

from __future__ import annotations

import argparse

from openai_server.reasoning import REASONING_PARSERS
from openai_server.tool_parsers import TOOL_PARSERS


def add_parser_flags(group) -> None:
    """Add the flags to an argparse parser or argument group."""
    group.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="chat: return the <think> part as reasoning_content (default: off)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="chat: requests may give tools (tool_choice auto); calls in the output become tool_calls",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes its tool calls (hermes: <tool_call> blocks, as Qwen2.5 and Qwen3; llama3_json: "
        "a reply of JSON call objects, as Llama 3.1-3.3; mistral: a reply of a JSON list of calls)",
    )


def check_parser_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse's usage error (exit 2) for flags that need each other."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")


def parser_classes(args: argparse.Namespace) -> tuple[type | None, type | None]:
    """(the reasoning parser, the tool-call parser) the flags ask for; None where off."""
    reasoning = REASONING_PARSERS[args.reasoning_parser] if args.reasoning_parser else None
    return reasoning, TOOL_PARSERS[args.tool_call_parser] if args.enable_auto_tool_choice else None


def parser_flags_args(args: argparse.Namespace) -> list[str]:
    """The flags as given, for the front-end's command line."""
    out = ["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else []
    out += ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    return out + (["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else [])
