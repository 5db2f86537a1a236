"""``python -m openai_server --address tcp://127.0.0.1:8765 --port 8000``: the OpenAI-compatible HTTP
front-end for a running coordinator. ``python launch.py --http-port PORT`` starts it for you, on a socket it
bound before loading the model (``--fd``), and it exits with its parent (``--parent-pid``)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
import time

from openai_server import STOP_SIGNAL
from openai_server.app import build_app
from openai_server.engine_client import EngineClient
from openai_server.metrics import Metrics
from openai_server.parser_flags import add_parser_flags, check_parser_flags, parser_classes
from openai_server.state import ServerState
from protocol.errors import EngineDeadError
from settings.cli_logging import add_log_level_flag, configure_logging
from settings.defaults import HOST, HTTP_PORT, LOG_STATS_INTERVAL_S, ZMQ_ADDRESS
from settings.env import settings
from settings.loopback import key_refusal

log = logging.getLogger("nanoserve.http")
_PR_SET_PDEATHSIG = 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m openai_server",
        description="OpenAI-compatible HTTP API for a running nanoserve coordinator.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--address",
        default=settings().address or ZMQ_ADDRESS,
        help=f"the coordinator's ZMQ address, or unix:PATH for its local socket (default: $NANOSERVE_ADDRESS or "
        f"{ZMQ_ADDRESS})",
    )
    p.add_argument("--host", default=HOST, help=f"interface to listen on (default {HOST})")
    p.add_argument("--port", type=int, default=HTTP_PORT, help=f"HTTP port (default {HTTP_PORT}; 0 = a free one)")
    p.add_argument("--fd", type=int, default=None, help="listen on this inherited, already bound socket instead")
    p.add_argument(
        "--api-key", default=settings().api_key, help="key HTTP clients must send; also the coordinator's token "
        "(env NANOSERVE_API_KEY)",
    )  # fmt: skip
    p.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="model name(s) in the API: requests may name any, responses and metrics the first (default: the model "
        "path)",
    )  # fmt: skip
    add_parser_flags(p)
    p.add_argument(
        "--max-body-bytes", type=int, default=None, help="larger HTTP request bodies get a 413, unread (default: "
        "the coordinator's --max-message-bytes)",
    )  # fmt: skip
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=LOG_STATS_INTERVAL_S,
        help=f"seconds between throughput log lines (default {LOG_STATS_INTERVAL_S:g})",
    )
    p.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the coordinator")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone; ignore SIGINT and SIGTERM (the parent stops us with SIGUSR1)",
    )
    add_log_level_flag(p)
    return p


def _die_with_parent(parent_pid: int) -> None:
    try:  # the kernel sends STOP_SIGNAL when the parent dies; the pid check below covers the race before this call
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, STOP_SIGNAL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        log.error("parent process %d is gone before the front-end started", parent_pid)
        sys.exit(1)


class _Parent:
    """The parent (launch.py, our coordinator) watched: its STOP_SIGNAL stops us cleanly, but its death (seen by
    the pid check, or as PR_SET_PDEATHSIG's STOP_SIGNAL) fails the requests in flight and makes us exit 1."""

    def __init__(self, pid: int, server, engine: EngineClient) -> None:
        self.pid, self.server, self.engine = pid, server, engine
        self.gone = False

    def on_stop_signal(self) -> None:
        if os.getppid() != self.pid:  # the kernel reparents us before it sends the parent-death signal
            self._gone()
        else:
            self.server.handle_exit(STOP_SIGNAL, None)

    async def watch(self) -> None:
        while os.getppid() == self.pid:
            await asyncio.sleep(0.5)
        self._gone()

    def _gone(self) -> None:
        if self.gone:
            return
        self.gone = True
        log.error("parent process %d is gone: failing the requests in flight and exiting with code 1", self.pid)
        # its coordinator is gone with it: end the requests in flight now, not after the graceful shutdown's wait
        self.engine.client.fail_all(EngineDeadError(f"the coordinator (process {self.pid}) is gone"))
        self.server.should_exit = True


async def _log_stats(engine: EngineClient, interval: float) -> None:
    """One line every ``interval`` seconds while the engine has work, as vLLM logs."""
    prev, prev_t = None, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        try:
            s = await engine.control(engine.client.stats())
        except Exception as e:
            log.warning("engine stats unavailable: %s: %s", type(e).__name__, e)
            continue
        now = time.monotonic()
        prompt = s["prompt_tokens"] + s["prefix_cache_hit_tokens"]
        if prev is not None:
            dt = max(now - prev_t, 1e-9)
            prompt_rate, gen_rate = (prompt - prev[0]) / dt, (s["output_tokens"] - prev[1]) / dt
            if prompt_rate or gen_rate or s["running"] or s["waiting"]:
                log.info(
                    "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                    "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    prompt_rate, gen_rate, s["running"], s["waiting"], 100 * s["kv_usage"],
                    100 * s["prefix_cache_hit_rate"],
                )  # fmt: skip
        prev, prev_t = (prompt, s["output_tokens"]), now


def _listen_socket(args) -> socket.socket:
    """The listening socket, wrapped from its descriptor so that its protocol reads as TCP: asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on connections of a socket that says so, and with Nagle on an SSE event
    waits for the client's delayed ACK (~40 ms)."""
    if args.fd is not None:
        fd = args.fd
    else:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        fd = socket.create_server((args.host, args.port), family=family).detach()
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return sock


async def serve(args) -> int:
    import uvicorn

    from openai_server.uvicorn_server import Server

    engine = None
    try:
        engine = EngineClient(args.address, args.api_key, args.served_model_name)  # unix:PATH connects here
        await engine.connect(args.connect_timeout)
    except Exception as e:
        log.error("no answer from the coordinator at %s: %s: %s", args.address, type(e).__name__, e)
        if engine is not None:
            await engine.close()
        return 1
    state = ServerState(engine, Metrics(engine.served_model_name), args.api_key, *parser_classes(args))
    sock = _listen_socket(args)
    max_body = args.max_body_bytes or engine.max_message_bytes
    config = uvicorn.Config(
        build_app(state, max_body), log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5
    )
    server = Server(config)
    parent = None if args.parent_pid is None else _Parent(args.parent_pid, server, engine)
    if parent is not None:  # how the parent stops us (SIGINT and SIGTERM are its own to act on)
        asyncio.get_running_loop().add_signal_handler(STOP_SIGNAL, parent.on_stop_signal)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    tasks = [asyncio.ensure_future(_log_stats(engine, args.log_stats_interval))]
    if parent is not None:
        tasks.append(asyncio.ensure_future(parent.watch()))
    if server.started:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"nanoserve OpenAI API on http://{shown}:{port}/v1 (model {engine.served_model_name!r})", flush=True)
    try:
        await serving
    finally:
        for t in tasks:
            t.cancel()
        await engine.close()
    return 0 if server.started and not (parent and parent.gone) else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refusal = None if args.fd is not None else key_refusal(args.host, args.api_key, "--api-key")
    if refusal:
        parser.error(refusal)
    check_parser_flags(parser, args)
    configure_logging(args.log_level)
    if args.parent_pid is not None:
        # Ctrl-C and systemd's stop reach the whole process group: launch.py drains the requests in flight first,
        # then stops us with STOP_SIGNAL
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _die_with_parent(args.parent_pid)
    try:  # uvloop when installed (a dependency on Linux), as vLLM's server runs: a shorter path per event
        import uvloop
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
