"""Serve a model over ZMQ: ``python launch.py`` (no arguments: the embedded tiny default model on
tcp://127.0.0.1:8765); ``--http-port PORT`` adds the OpenAI-compatible HTTP API (a front-end process, see
openai_server/). ``--prompt`` prints completions and exits without serving. Every engine argument
(coordinator/config.py's EngineConfig) is a flag, generated from the dataclass. See docs/SERVING.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys

from coordinator.config import EngineArgError, EngineConfig
from coordinator.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S
from openai_server.child import HttpFrontEnd, bind_http
from openai_server.parser_flags import add_parser_flags, check_parser_flags
from settings.cli_logging import add_log_level_flag, configure_logging
from settings.env import settings

log = logging.getLogger("nanoserve.launch")

_TYPES = {"int": int, "float": float, "str": str}
MAX_PORT = 65535


def port_number(text: str) -> int:
    """argparse type of a TCP port: 0 (a free one, picked at bind time) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"port must be in 0..{MAX_PORT} (0 = pick a free one), got {value}")
    return value


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python launch.py",
        description="Serve a model to nanoserve clients over ZMQ (or, with --prompt, print completions and exit).",
        allow_abbrev=False,
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port_number, default=8765, help="port (default 8765; 0 = pick a free one)")
    s.add_argument(
        "--api-key",
        "--token",
        dest="token",
        default=settings().api_key,
        help="key every request must carry (HTTP: 'Authorization: Bearer KEY'; ZMQ: the token); required for a "
        "non-loopback --host (env NANOSERVE_API_KEY)",
    )
    s.add_argument(
        "--max-pending-requests", type=int, default=4096, help="past this, requests are refused (default 4096)"
    )
    s.add_argument(
        "--max-pending-per-client",
        type=int,
        default=None,
        help="past this many pending requests of one client (a ZMQ connection, or an HTTP user), its further "
        "requests are refused (default 1024, at most --max-pending-requests)",
    )
    s.add_argument(
        "--client-heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds a ZMQ client with requests pending may send nothing (clients send a keep-alive every "
        "second) before its requests are aborted (default 10; 0 = never)",
    )
    s.add_argument(
        "--max-message-bytes", type=int, default=8 << 20, help="larger client frames are refused (default 8 MiB)"
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
    h = p.add_argument_group("OpenAI-compatible HTTP API (openai_server)")
    h.add_argument(
        "--http-port",
        type=port_number,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on this port (0 = a free one)",
    )
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
        default=10.0,
        help="seconds between the HTTP front-end's throughput log lines (default 10)",
    )
    o = p.add_argument_group("offline (no server)")
    o.add_argument("--prompt", action="extend", nargs="+", help="print completions of these prompts and exit")
    o.add_argument("--max-tokens", type=int, default=32, help="--prompt: tokens to generate (default 32)")
    o.add_argument("--temperature", type=float, default=0.0, help="--prompt: temperature (default 0 = greedy)")
    e = p.add_argument_group("engine (coordinator/config.py EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        _engine_flag(e, f)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the checks that span several flags (argparse's usage error, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.http_port is not None and args.http_port != 0 and args.http_port == args.port and not args.prompt:
        parser.error(
            f"argument --http-port: {args.http_port} clashes with --port {args.port} (the ZMQ port): pick another"
        )
    check_parser_flags(parser, args)
    return args


def _engine_kwargs(args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def _graceful_exit(signum, frame):
    raise SystemExit(0)  # during start-up: unwinds through the engine's cleanup (workers stopped, files removed)


def _offline(args, kwargs) -> int:
    from nanoserve.llm import LLM
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    with LLM(**kwargs) as llm:
        for prompt, c in zip(args.prompt, llm.generate(args.prompt, params, use_tqdm=False)):
            print(f"Prompt: {prompt!r}, Generated text: {c.text!r}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    kwargs = _engine_kwargs(args)
    kwargs.setdefault("worker_secret", settings().worker_secret or args.token or "")  # --api-key implies it
    signal.signal(signal.SIGTERM, _graceful_exit)
    signal.signal(signal.SIGINT, _graceful_exit)
    server = http_sock = http_proc = None
    if not args.prompt:
        from coordinator.client_socket import is_loopback
        from coordinator.server import Server  # zmq only: binding first, a port in use fails at once

        if not is_loopback(args.host) and not args.token:
            print(
                f"error: listening on the non-loopback host {args.host!r} needs --api-key (alias --token)",
                file=sys.stderr,
            )
            return 1
        try:
            server = Server(
                args.host,
                args.port,
                args.token,
                args.max_pending_requests,
                args.max_message_bytes,
                max_pending_per_client=args.max_pending_per_client,
                client_heartbeat_timeout_s=args.client_heartbeat_timeout,
                shutdown_timeout_s=args.shutdown_timeout,
            )
            if args.http_port is not None:
                http_sock = bind_http(args.host, args.http_port)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            if server is not None:
                server.close(0)
            return 1
    engine = None
    try:
        cfg = EngineConfig.from_kwargs(**kwargs)
        if args.prompt:
            return _offline(args, kwargs)
        from coordinator.engine import Engine

        if cfg.external_workers:
            log.info(
                "waiting for %d worker(s): torchrun --nproc-per-node %d -m worker --coordinator %s",
                cfg.tensor_parallel_size,
                cfg.tensor_parallel_size,
                cfg.worker_address,
            )
        engine = Engine(cfg)
        server.install_signal_handlers()  # from here on a signal drains the requests in flight (a second: aborts)
        print(f"nanoserve listening on {server.address}", flush=True)
        log.info(
            "model %s, max_model_len %d, %d KV blocks", cfg.model, engine.max_model_len, engine.block_manager.num_blocks
        )
        if http_sock is not None:  # it prints its own line (http://HOST:PORT/v1) once it answers
            served_names = args.served_model_name or [kwargs.get("model") or cfg.model]
            http_proc = HttpFrontEnd(args, http_sock, server.address, served_names, server.fail)
            http_sock.close()  # the front-end holds it now
        server.serve(engine)
        if server.failure:  # a child died unasked, or the engine did: a supervisor must see a failure
            log.error("exiting with code 1: %s", server.failure)
            return 1
        log.info("shutting down")
    except EngineArgError as e:  # refused before any worker starts (with the model's config, where it needs it)
        print(f"error: argument --{e.name.replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        log.error("%s: %s", type(e).__name__, e)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if http_proc is not None:
            http_proc.stop()
        if http_sock is not None:
            http_sock.close()
        if engine is not None:
            engine.shutdown()
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
