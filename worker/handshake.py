"""A worker's side of the start-up's authentication (protocol/worker_auth.py), and its watchdog for the one wait
its step loop cannot leave by itself."""

from __future__ import annotations

import os
import sys
import time
from typing import Protocol

from protocol.messages import AuthChallenge, AuthResponse, Shutdown
from protocol.worker_auth import coordinator_proof, matches, worker_proof


class Worker(Protocol):
    """What the handshake and the watchdog use of worker.worker.Worker (named structurally: no import circle)."""

    rank: int
    world_size: int
    address: str
    secret: str | None
    leaving: bool
    channel: object

    def send(self, msg: object) -> None: ...

    def recv(self, wait: bool = True) -> object: ...


# a worker whose coordinator connection dropped while it is stuck (a collective whose peer rank or network is gone)
# exits after this long: nothing else would end a wait that gloo or NCCL may hold for many minutes
ORPHAN_GRACE_S = 5.0


class Refused(Exception):
    """The start-up failed authentication (either side) or the coordinator refused this worker."""


def exit_when_orphaned(worker: Worker) -> None:
    """The step loop notices a lost coordinator within a second, unless a step holds it: then end the process
    from here, so that no worker outlives its service (a killed peer rank, a host cut off)."""
    while not worker.channel.dropped_now():
        time.sleep(1.0)
    time.sleep(ORPHAN_GRACE_S)  # the step loop's own exit (CoordinatorGone, or a Shutdown's drain) goes first
    if worker.leaving:
        return
    print(f"worker rank {worker.rank}: lost the coordinator while blocked in a step: exiting", file=sys.stderr)
    os._exit(1)


def authenticate(worker: Worker, msg: object, nonce: bytes) -> object | None:
    """The coordinator's first answer ``msg``, checked: a challenge is answered once both sides have proved they
    hold the secret (None: the config comes next); anything else is returned. Nothing from a coordinator that
    cannot prove it is ever acted on."""
    if isinstance(msg, AuthChallenge):
        if not worker.secret:
            worker.send(AuthResponse(worker.rank, b"", "it holds no worker secret"))  # for the coordinator's log
            raise Refused(
                f"the coordinator at {worker.address} requires a worker secret: set NANOSERVE_WORKER_SECRET (or "
                "NANOSERVE_API_KEY) in this worker's environment"
            )
        expected = coordinator_proof(worker.secret, nonce, msg.nonce, worker.rank, worker.world_size)
        if not matches(expected, msg.proof):
            worker.send(AuthResponse(worker.rank, b"", "its worker secret differs (the coordinator's proof failed)"))
            raise Refused(f"the coordinator at {worker.address} does not hold this worker's secret")
        worker.send(
            AuthResponse(worker.rank, worker_proof(worker.secret, nonce, msg.nonce, worker.rank, worker.world_size))
        )
        return None
    if worker.secret and not isinstance(msg, Shutdown):
        raise Refused(
            f"the coordinator at {worker.address} did not prove it holds the worker secret (it has none, or an "
            "older version): refusing its work"
        )
    return msg
