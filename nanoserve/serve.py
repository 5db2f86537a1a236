"""Serving, for ``python launch.py`` and ``nanoserve serve``: bind the ZMQ port (and the HTTP one), start the engine
and its workers, run the HTTP front-end as a child process, serve until a signal, and exit 0 only when asked to stop
(1 when a worker or the front-end dies). ``--prompt`` prints completions and exits without serving. The command
line is nanoserve/serve_args.py's; see docs/SERVING.md.

Start-up order, for a fast start: the arguments are checked (torch-free), then the workers are spawned and then the
HTTP front-end, and only then does this process load its engine's modules (torch where a GPU driver is present,
transformers' tokenizer), so every process's imports (1-2 s each) run at once. On a host without a GPU driver, serving
the embedded default model, this process never loads torch (tests/serving/test_torch_free_coordinator.py). Once it
listens it logs one line of its start-up phases (settings/startup_phases.py), after each worker's own."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

from coordinator.config import EngineArgError, EngineConfig
from coordinator.model_source import served_model_name
from nanoserve.serve_args import engine_kwargs, parse_args
from openai_server.child import HttpFrontEnd, bind_http
from settings.cli_logging import configure_logging
from settings.env import settings
from settings.loopback import key_refusal
from settings.startup_phases import PHASES

log = logging.getLogger("nanoserve.launch")


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _warn_oversubscribed(cfg: EngineConfig) -> None:
    cores = cpu_cores()
    if cfg.device == "cpu" and cfg.tensor_parallel_size > cores:
        log.warning(
            "--tp %d on the CPU: %d worker processes share %d CPU core(s), so each step waits on the slowest; "
            "use --tp %d or less for speed (more is fine to test tensor parallelism)",
            cfg.tensor_parallel_size,
            cfg.tensor_parallel_size,
            cores,
            cores,
        )


def _graceful_exit(signum, frame):
    raise SystemExit(0)  # during start-up: unwinds through the engine's cleanup (workers stopped, files removed)


def _config_and_workers(kwargs: dict):
    """(the engine's config, its workers spawned early or None): every argument is checked with the device left to
    "cpu" (torch-free), the workers are spawned, and the config is made again with the real device default, whose
    torch import then runs beside theirs. External (torchrun) workers are not ours to spawn."""
    probe = EngineConfig.from_kwargs(**{**kwargs, "device": kwargs.get("device") or "cpu"})
    PHASES.mark("config")
    if probe.external_workers:
        return (probe if kwargs.get("device") else EngineConfig.from_kwargs(**kwargs)), None
    from coordinator.worker_group import WorkerGroup  # zmq only

    workers = WorkerGroup(None, probe.tensor_parallel_size, secret=probe.worker_secret)
    PHASES.mark("spawn workers")
    try:
        if kwargs.get("device"):
            return probe, workers
        # the sources resolved once (a Hub id is a directory now): the second pass only picks the device
        return EngineConfig.from_kwargs(**{**kwargs, "model": probe.model, "tokenizer": probe.tokenizer}), workers
    except BaseException:
        _discard(workers)
        raise


def _discard(workers) -> None:
    """Stop workers spawned early that no engine adopted: none was configured (no device, no collective), so they
    are killed at once rather than waited for."""
    for proc in workers.procs:
        if proc.poll() is None:
            proc.kill()
    try:
        workers.shutdown()
    except Exception as e:  # already shut down by a failed adoption: nothing left to release
        log.debug("discarding early workers: %s", e)


def _front_end(args, kwargs: dict, cfg: EngineConfig, http_sock, server) -> HttpFrontEnd:
    """The HTTP front-end, spawned before the engine starts: it waits for the engine's first answer as long as the
    start-up may take (the coordinator's own part, a minute at most, then each of the workers' three handshake
    waits), and the parent stops it on every way out (the kernel, if the parent dies)."""
    served_names = args.served_model_name or [served_model_name(kwargs.get("model", ""))]
    wait_s = 60.0 + 3 * cfg.worker_timeout_s
    address = server.listen_locally()  # a Unix socket: no ZMQ I/O threads on the first token's way (server.py)
    return HttpFrontEnd(args, http_sock, address, served_names, server.fail, connect_timeout_s=wait_s)


def _offline(args, kwargs) -> int:
    from nanoserve.llm import LLM
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    with LLM(**kwargs) as llm:
        for prompt, c in zip(args.prompt, llm.generate(args.prompt, params, use_tqdm=False)):
            print(f"Prompt: {prompt!r}, Generated text: {c.text!r}", flush=True)
    return 0


def main(argv: list[str] | None = None, command: str = "launch") -> int:
    """``command``: "launch" (``python launch.py``) or "serve" (``nanoserve serve``): which flags the ports have."""
    args = parse_args(argv, command)
    configure_logging(args.log_level)
    kwargs = engine_kwargs(args)
    kwargs.setdefault("worker_secret", settings().worker_secret or args.token or "")  # --api-key implies it
    signal.signal(signal.SIGTERM, _graceful_exit)
    signal.signal(signal.SIGINT, _graceful_exit)
    server = http_sock = http_proc = None
    if not args.prompt:
        from coordinator.server import Server  # zmq only: binding first, a port in use fails at once

        refusal = key_refusal(args.host, args.token, "--api-key (alias --token)")
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
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
    engine = early = None
    PHASES.mark("imports + bind")
    try:
        if args.prompt:
            cfg = EngineConfig.from_kwargs(**kwargs)
            _warn_oversubscribed(cfg)
            return _offline(args, kwargs)
        gc.disable()  # start-up allocates much and frees little: collections cost ~10% of the imports' CPU
        cfg, early = _config_and_workers(kwargs)
        _warn_oversubscribed(cfg)
        PHASES.mark("device default")
        # the HTTP front-end's imports run beside ours; it prints its line (http://HOST:PORT/v1) once we answer
        if http_sock is not None:
            http_proc = _front_end(args, kwargs, cfg, http_sock, server)
            http_sock.close()  # the front-end holds it now
            PHASES.mark("spawn front-end")
        from coordinator.engine import Engine  # not transformers: the engine imports it once the config is sent

        gc.freeze()  # the imports' objects, uncollected (~8k unreachable of ~300k): the engine's collection skips them
        PHASES.mark("engine imports")

        if cfg.external_workers:
            log.info(
                "waiting for %d worker(s): torchrun --nproc-per-node %d -m worker --coordinator %s",
                cfg.tensor_parallel_size,
                cfg.tensor_parallel_size,
                cfg.worker_address,
            )
        engine = Engine(cfg, early)
        gc.enable()  # the engine froze what start-up built (gc.freeze): later collections skip it
        PHASES.mark("engine: tokenizer + workers")
        server.install_signal_handlers()  # from here on a signal drains the requests in flight (a second: aborts)
        PHASES.report("coordinator")  # benchmarks/startup.py reads it
        print(f"nanoserve listening on {server.address}", flush=True)
        log.info(
            "model %s, max_model_len %d, %d KV blocks", cfg.model, engine.max_model_len, engine.block_manager.num_blocks
        )
        server.serve(engine)
        if server.failure:  # a child died unasked, or the engine did: a supervisor must see a failure
            log.error("exiting with code 1: %s", server.failure)
            return 1
        log.info("shutting down")
    except EngineArgError as e:  # refused before any worker starts (with the model's config, where it needs it)
        message = str(e).removeprefix(f"{e.name}: ")  # the flag already names the field
        print(f"error: argument --{e.name.replace('_', '-')}: {message}", file=sys.stderr)
        return 2
    except Exception as e:
        log.error("%s: %s", type(e).__name__, e)
        return 1
    finally:
        gc.enable()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if http_proc is not None:
            http_proc.stop()
        if http_sock is not None:
            http_sock.close()
        if engine is not None:
            engine.shutdown()
        elif early is not None:
            _discard(early)
        if server is not None:
            server.close()
    return 0
