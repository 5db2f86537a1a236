"""Serve a model over ZMQ: ``python launch.py`` (no arguments: the embedded tiny default model on
tcp://127.0.0.1:8765). ``--prompt`` prints completions and exits without serving. Every engine argument
(coordinator/config.py's EngineConfig) is a flag, generated from the dataclass. See docs/SERVING.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys

from coordinator.config import EngineArgError, EngineConfig
from protocol.settings import settings

log = logging.getLogger("nanoserve.launch")

_TYPES = {"int": int, "float": float, "str": str}


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
    s.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 = pick a free one)")
    s.add_argument(
        "--token",
        default=settings().api_key,
        help="shared secret every request must carry; required for a non-loopback --host (env NANOSERVE_API_KEY)",
    )
    s.add_argument(
        "--max-pending-requests", type=int, default=4096, help="past this, requests are refused (default 4096)"
    )
    s.add_argument(
        "--max-message-bytes", type=int, default=8 << 20, help="larger client frames are refused (default 8 MiB)"
    )
    s.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level on stderr (default INFO)",
    )
    o = p.add_argument_group("offline (no server)")
    o.add_argument("--prompt", action="extend", nargs="+", help="print completions of these prompts and exit")
    o.add_argument("--max-tokens", type=int, default=32, help="--prompt: tokens to generate (default 32)")
    o.add_argument("--temperature", type=float, default=0.0, help="--prompt: temperature (default 0 = greedy)")
    e = p.add_argument_group("engine (coordinator/config.py EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        _engine_flag(e, f)
    return p


def _engine_kwargs(args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def _graceful_exit(signum, frame):
    raise SystemExit(0)  # during start-up: unwinds through the engine's cleanup (workers stopped, files removed)


def _offline(args, kwargs) -> int:
    from client.llm import LLM
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    with LLM(**kwargs) as llm:
        for prompt, c in zip(args.prompt, llm.generate(args.prompt, params, use_tqdm=False)):
            print(f"Prompt: {prompt!r}, Generated text: {c.text!r}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    kwargs = _engine_kwargs(args)
    signal.signal(signal.SIGTERM, _graceful_exit)
    signal.signal(signal.SIGINT, _graceful_exit)
    server = None
    if not args.prompt:
        from coordinator.server import Server  # zmq only: binding first, a port in use fails in well under a second

        try:
            server = Server(args.host, args.port, args.token, args.max_pending_requests, args.max_message_bytes)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    engine = None
    try:
        try:
            cfg = EngineConfig.from_kwargs(**kwargs)
        except EngineArgError as e:  # before any worker starts
            print(f"error: argument --{e.name.replace('_', '-')}: {e}", file=sys.stderr)
            return 2
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
        server.install_signal_handlers()  # from here on a signal ends the loop; in-flight requests get "abort"
        print(f"nanoserve listening on {server.address}", flush=True)
        log.info(
            "model %s, max_model_len %d, %d KV blocks", cfg.model, engine.max_model_len, engine.block_manager.num_blocks
        )
        server.serve(engine)
        log.info("shutting down")
    except Exception as e:
        log.error("%s: %s", type(e).__name__, e)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if engine is not None:
            engine.shutdown()
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
