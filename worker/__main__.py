"""``python -m worker --coordinator ADDR``: one worker process; under torchrun, rank and world size come from its
environment. Parses the flags, ties the process's life to its parent's, says hello to the coordinator, loads torch
and the worker's modules (while the coordinator loads its own), and turns every ending into an exit code."""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import signal
import sys
import traceback

from protocol.messages import WorkerError
from settings.env import distributed_env, settings
from settings.startup_phases import PHASES  # its clock counts from the process's start
from worker.handshake import Refused
from worker.worker import CoordinatorGone, CoordinatorUnreachable, Worker


def _die_with_parent() -> None:
    """Linux: have the kernel kill us when the process that spawned us exits (no orphan holds a GPU)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _load_modules() -> None:
    """What every worker imports before its first step (torch, Triton, the model code): 1-5 s, done once the
    coordinator has admitted us (worker/worker.py), so it overlaps the coordinator's own imports."""
    gc.disable()  # imports allocate much and free little: collections cost ~10% of their CPU
    try:
        import torch  # noqa: F401

        import worker.model_runner  # noqa: F401
        import worker.startup  # noqa: F401

        # then out of every later collection's reach: the full collection at ready (worker/worker.py) walks only
        # what start-up built after this. Frozen uncollected (~7k unreachable of ~190k objects, as the coordinator's
        # imports are): collecting them first took 0.15-0.35 s of a start-up whose critical path this now is
        gc.freeze()
    finally:
        gc.enable()
    PHASES.mark("imports")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m worker",
        description="nanoserve worker process",
        epilog="The worker secret comes from the environment only: NANOSERVE_WORKER_SECRET, else NANOSERVE_API_KEY "
        "(a coordinator with a secret admits only workers that prove they hold it, and they work only for it).",
        allow_abbrev=False,
    )
    p.add_argument("--coordinator", required=True, help="ZMQ address of the coordinator, e.g. tcp://host:port")
    p.add_argument("--rank", type=int, default=None, help="default: $RANK (torchrun)")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE (torchrun)")
    p.add_argument("--local-rank", type=int, default=None, help="default: $LOCAL_RANK (torchrun)")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=0,
        help="exit when this process is no longer our parent; ignore SIGINT and SIGTERM (the parent stops us)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="give up when no coordinator answers at --coordinator within this long (default 60; 0 = wait forever)",
    )
    args = p.parse_args(argv)
    env = distributed_env(args.rank, args.world_size, args.local_rank)
    rank, world, local = env.rank, env.world_size, env.local_rank
    if args.parent_pid:
        # Ctrl-C and systemd's stop reach the whole process group: the coordinator must abort its requests first,
        # then send Shutdown (and the kernel kills us if it dies instead)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _die_with_parent()
        if os.getppid() != args.parent_pid:
            return 1
    secret = settings().worker_secret  # from the environment only: argv is readable by any local user
    worker = Worker(args.coordinator, rank, world, local, args.parent_pid, args.connect_timeout, secret)
    code = 1
    try:
        code = worker.run(load_modules=_load_modules)
    except CoordinatorGone:
        code = 1
    except (CoordinatorUnreachable, Refused) as e:
        print(f"worker rank {rank}: error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:  # report any failure (load error, OOM, bad step) to the coordinator
        traceback.print_exc()
        try:
            worker.send(WorkerError(rank, f"{type(e).__name__}: {e}"))
        except Exception:
            pass
    finally:
        try:
            worker.close()
        except Exception:
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
