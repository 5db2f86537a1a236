"""The serving command line, one parser for both ways in: ``python launch.py`` (ZMQ on ``--port``, HTTP only with
``--http-port``) and ``nanoserve serve [MODEL]`` (vLLM's shape: HTTP on ``--port``, default 8000, and ZMQ on
``--zmq-port``). Every engine argument (coordinator/config.py's EngineConfig) is a flag, generated from the
dataclass. Importing this loads no torch: ``--help`` and argument errors come at once."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from coordinator.client_limits import DEFAULT_CLIENT_HEARTBEAT_TIMEOUT_S, DEFAULT_MAX_PENDING_PER_CLIENT
from coordinator.config import EngineConfig
from coordinator.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S
from openai_server.parser_flags import add_parser_flags, check_parser_flags
from protocol.sampling_params import SamplingParams
from settings import defaults
from settings.cli_logging import add_log_level_flag
from settings.env import settings

_TYPES = {"int": int, "float": float, "str": str}
MAX_PORT = 65535
PROGS = {"launch": "python launch.py", "serve": "nanoserve serve"}
# a Hugging Face Hub repo id: NAME or NAMESPACE/NAME (letters, digits, '-', '_', '.')
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")


def port_number(text: str) -> int:
    """argparse type of a TCP port: 0 (a free one, picked at bind time) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"port must be in 0..{MAX_PORT} (0 = pick a free one), got {value}")
    return value


def model_path_problem(text: str) -> str | None:
    """Why ``text`` cannot name a model, judged from the file system alone (no torch, no network), or None: an
    existing directory, or a name shaped like a Hub id that is not a local path (the resolver looks that up)."""
    path = Path(text).expanduser()
    if path.is_dir():
        return None
    if path.exists():
        return f"{text!r} is a file, not a model directory (a directory holding config.json and *.safetensors)"
    if _HUB_ID.fullmatch(text) and ".." not in text:
        return None
    return f"{text!r} does not exist (neither a model directory nor a Hugging Face Hub id such as Qwen/Qwen3-0.6B)"


def _engine_flag(parser: argparse._ActionGroup, f: dataclasses.Field) -> None:
    flag = "--" + f.name.replace("_", "-")
    names = [flag, "--tp"] if f.name == "tensor_parallel_size" else [flag]
    help_ = f.metadata["help"] + (f" (default: {f.default!r})" if f.default != "" else "")
    # default=SUPPRESS: only flags given on the command line reach EngineConfig, the rest keep its defaults
    kw = dict(dest=f.name, default=argparse.SUPPRESS, help=help_)
    if f.metadata["choices"]:
        kw["choices"] = f.metadata["choices"]
    ann = str(f.type).replace(" ", "")
    if ann == "bool":
        parser.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
    elif ann in _TYPES:
        metavar = None if f.metadata["choices"] else ann.upper()  # with choices argparse lists them instead
        parser.add_argument(*names, type=_TYPES[ann], metavar=metavar, **kw)
    else:  # a structured field: JSON on the command line
        parser.add_argument(*names, type=json.loads, metavar="JSON", **kw)


def _port_flags(s: argparse._ArgumentGroup, h: argparse._ArgumentGroup, command: str) -> None:
    """The two ports. ``launch``: --port is ZMQ's and HTTP is off unless --http-port; ``serve``: --port is HTTP's
    (what a `vllm serve` user types), also spelled --http-port, and ZMQ's is --zmq-port."""
    zmq_help = f"the ZMQ port of nanoserve's own clients (default {defaults.ZMQ_PORT}; 0 = pick a free one)"
    zmq_names = ["--port"] if command == "launch" else ["--zmq-port"]
    s.add_argument(*zmq_names, dest="port", type=port_number, default=defaults.ZMQ_PORT, help=zmq_help)
    if command == "launch":
        http_names, http_default = ["--http-port"], None
        http_help = "also serve the OpenAI-compatible HTTP API on this port (0 = a free one)"
    else:
        http_names, http_default = ["--port", "--http-port"], defaults.HTTP_PORT
        http_help = f"the OpenAI-compatible HTTP API's port (default {defaults.HTTP_PORT}; 0 = a free one)"
    h.add_argument(*http_names, dest="http_port", type=port_number, default=http_default, help=http_help)


def build_parser(command: str = "launch") -> argparse.ArgumentParser:
    """``command``: "launch" (``python launch.py``) or "serve" (``nanoserve serve``)."""
    p = argparse.ArgumentParser(
        prog=PROGS[command],
        description="Serve a model to nanoserve clients over ZMQ"
        + (" and the OpenAI-compatible HTTP API" if command == "serve" else "")
        + " (or, with --prompt, print completions and exit).",
        allow_abbrev=False,
    )
    if command == "serve":
        p.add_argument(
            "model_tag", nargs="?", default=None, metavar="MODEL", help="the model (as --model; default: embedded)"
        )
    s = p.add_argument_group("server")
    h = p.add_argument_group("OpenAI-compatible HTTP API (openai_server)")
    s.add_argument("--host", default=defaults.HOST, help=f"interface to listen on (default {defaults.HOST})")
    _port_flags(s, h, command)
    s.add_argument(
        "--api-key",
        "--token",
        dest="token",
        default=settings().api_key,
        help="key every request must carry (HTTP: 'Authorization: Bearer KEY'; ZMQ: the token); required for a "
        "non-loopback --host (env NANOSERVE_API_KEY)",
    )
    s.add_argument(
        "--max-pending-requests",
        type=int,
        default=defaults.MAX_PENDING_REQUESTS,
        help=f"past this, requests are refused (default {defaults.MAX_PENDING_REQUESTS})",
    )
    s.add_argument(
        "--max-pending-per-client",
        type=int,
        default=None,
        help="past this many pending requests of one client (a ZMQ connection, or an HTTP user), its further "
        f"requests are refused (default {DEFAULT_MAX_PENDING_PER_CLIENT}, at most --max-pending-requests)",
    )
    s.add_argument(
        "--client-heartbeat-timeout",
        type=float,
        default=DEFAULT_CLIENT_HEARTBEAT_TIMEOUT_S,
        help="seconds a ZMQ client with requests pending may send nothing (clients send a keep-alive every "
        f"second) before its requests are aborted (default {DEFAULT_CLIENT_HEARTBEAT_TIMEOUT_S:g}; 0 = never)",
    )
    s.add_argument(
        "--max-message-bytes",
        type=int,
        default=defaults.MAX_MESSAGE_BYTES,
        help=f"larger client frames are refused (default {defaults.MAX_MESSAGE_BYTES >> 20} MiB)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, let in-flight requests finish for up to this long, then abort them (0 = at once; a "
        f"second signal aborts at once; default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    add_log_level_flag(s)
    h.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name(s) in the HTTP API: requests may name any, responses and metrics the first "
        "(default: --model as given)",
    )
    add_parser_flags(h)
    h.add_argument(
        "--log-stats-interval",
        type=float,
        default=defaults.LOG_STATS_INTERVAL_S,
        help=f"seconds between the HTTP front-end's throughput log lines (default {defaults.LOG_STATS_INTERVAL_S:g})",
    )
    o = p.add_argument_group("offline (no server)")
    o.add_argument("--prompt", action="extend", nargs="+", help="print completions of these prompts and exit")
    sp = SamplingParams()  # its defaults are vLLM's, so python -m client, LLM.generate and --prompt sample alike
    o.add_argument("--max-tokens", type=int, default=sp.max_tokens, help=f"--prompt: tokens to generate at most "
        f"(default {sp.max_tokens})")  # fmt: skip
    o.add_argument("--temperature", type=float, default=sp.temperature, help=f"--prompt: temperature (default "
        f"{sp.temperature:g}; 0 = greedy)")  # fmt: skip
    e = p.add_argument_group("engine (coordinator/config.py EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        _engine_flag(e, f)
    return p


def _check_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """MODEL and --model agree, and each path-like model or tokenizer is there (checked before anything starts)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if getattr(args, "model", tag) != tag:
            parser.error(f"MODEL {tag!r} and --model {args.model!r} name different models: give one")
        args.model = tag
    for name in ("model", "tokenizer"):
        value = getattr(args, name, "")
        problem = model_path_problem(value) if value else None
        if problem:
            parser.error(f"argument --{name}: {problem}")


def parse_args(argv: list[str] | None = None, command: str = "launch") -> argparse.Namespace:
    """The command line, with the checks that span several flags (argparse's usage error, exit 2)."""
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.http_port is not None and args.http_port != 0 and args.http_port == args.port and not args.prompt:
        http, zmq = ("--http-port", "--port") if command == "launch" else ("--port", "--zmq-port")
        parser.error(f"argument {http}: {args.http_port} clashes with {zmq} {args.port} (the ZMQ port): pick another")
    check_parser_flags(parser, args)
    _check_model(parser, args)
    return args


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments given on the command line; the rest keep EngineConfig's defaults, but for a server's
    prefill cap beside decodes (the offline LLM's default is throughput first)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {"max_prefill_beside_decodes": defaults.SERVER_PREFILL_BESIDE_DECODES} | {
        k: v for k, v in vars(args).items() if k in names
    }
