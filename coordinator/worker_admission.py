"""Which peers of the coordinator's worker socket become its ranks: each says hello, and, where the coordinator
has a worker secret, proves it holds it (protocol/worker_auth.py) after the coordinator has proved it too. Anyone
else is refused with a log line naming its address, and ignored from then on."""

from __future__ import annotations

import logging

import zmq

from protocol.codec import encode
from protocol.messages import PROTOCOL_VERSION, AuthChallenge, AuthResponse, Shutdown, WorkerHello
from protocol.worker_auth import coordinator_proof, matches, new_nonce, worker_proof

log = logging.getLogger("nanoserve.workers")


def peer_address(frame: zmq.Frame) -> str:
    """The sending peer's address: its IP over TCP (ZMQ's "Peer-Address"), else the endpoint kind."""
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, TypeError, ValueError):
        return "a local (ipc) endpoint"


class WorkerAdmission:
    """WorkerGroup's start-up half: it needs ``sock``, ``secret``, ``world_size``, ``_rank_of``, ``_ignored``,
    ``_noted`` and ``_recv``; it fills ``identities`` (one per rank) and ``_rank_of``."""

    def _admit_workers(self, deadline: float) -> None:
        pending = set(range(self.world_size))
        joined: dict[int, bytes] = {}
        challenged: dict[bytes, tuple[WorkerHello, bytes, str]] = {}  # identity -> (its hello, nonce sent, address)
        refused: list[str] = []
        while pending:
            try:
                identity, msg, peer = self._recv(deadline, "hello", pending, strangers=True)
            except TimeoutError as e:
                silent = [
                    f"a worker at {p} (says rank {h.rank}, host {h.hostname!r})" for h, _, p in challenged.values()
                ]
                notes = [f"refused: {'; '.join(refused)}"] * bool(refused)
                notes += [f"challenged, never answered: {'; '.join(silent)}"] * bool(silent)
                raise TimeoutError("; ".join([str(e), *notes])) from None
            if identity in self._rank_of:
                continue  # an accepted worker has nothing more to say before its config
            if isinstance(msg, WorkerHello):
                bad = self._check_hello(identity, msg)
                if bad:
                    refused.append(self._refuse(identity, peer, msg, bad))
                elif self.secret:
                    nonce = new_nonce()
                    challenged[identity] = (msg, nonce, peer)
                    proof = coordinator_proof(self.secret, msg.nonce, nonce, msg.rank, self.world_size)
                    self.sock.send_multipart([identity, encode(AuthChallenge(nonce, proof))])
                elif not (bad := self._admit(identity, peer, msg, joined)):
                    pending.discard(msg.rank)
                else:
                    refused.append(bad)
            elif isinstance(msg, AuthResponse) and identity in challenged:
                hello, nonce, _ = challenged.pop(identity)
                expected = worker_proof(self.secret, hello.nonce, nonce, hello.rank, self.world_size)
                if not matches(expected, msg.proof):
                    reason = "wrong worker secret" if msg.proof else "no proof (no worker secret)"
                    if msg.refusal:  # the worker's own account, as a quoted string: a peer's text, not ours
                        reason = f"the worker says {msg.refusal[:200]!r}"
                    refused.append(self._refuse(identity, peer, hello, reason))
                elif not (bad := self._admit(identity, peer, hello, joined)):
                    pending.discard(hello.rank)
                else:
                    refused.append(bad)
            else:
                refused.append(self._refuse(identity, peer, None, f"sent {type(msg).__name__} before any hello"))
        self.identities = [joined[r] for r in range(self.world_size)]

    def _ignore(self, identity: bytes, peer: str, why: str) -> None:
        self._ignored.add(identity)
        if identity not in self._noted:
            log.warning("ignoring a peer of the worker socket at %s (identity %r): %s", peer, identity[:32], why)
            self._noted.add(identity)

    def _refuse(self, identity: bytes, peer: str, hello: WorkerHello | None, reason: str) -> str:
        who = f"a worker at {peer}"
        if hello is not None:
            who += f" (says rank {hello.rank}, host {hello.hostname!r}, pid {hello.pid})"
        log.warning("refused %s: %s", who, reason)
        self._ignored.add(identity)
        try:
            self.sock.send_multipart([identity, encode(Shutdown(f"refused by the coordinator: {reason}"))], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        return f"{who}: {reason}"

    def _admit(self, identity: bytes, peer: str, hello: WorkerHello, joined: dict[int, bytes]) -> str:
        """Accept ``hello``'s worker as its rank; a reason to refuse it otherwise."""
        if hello.rank in joined:
            return self._refuse(identity, peer, hello, f"rank {hello.rank} has already joined")
        joined[hello.rank] = identity
        self._rank_of[identity] = hello.rank
        return ""

    def _check_hello(self, identity: bytes, msg: WorkerHello) -> str:
        """Why ``msg`` cannot join (a mismatch), or ''. Without a secret the start-up fails at once, naming it; with
        one, an unauthenticated peer must not be able to end the start-up, so the worker is refused instead."""
        if msg.protocol_version != PROTOCOL_VERSION:
            why = (
                f"protocol version mismatch: worker rank {msg.rank} speaks {msg.protocol_version}, "
                f"coordinator speaks {PROTOCOL_VERSION}"
            )
        elif msg.world_size != self.world_size or not 0 <= msg.rank < self.world_size:
            why = (
                f"worker rank {msg.rank} joined a world of size {msg.world_size}; this coordinator expects "
                f"tensor_parallel_size={self.world_size}"
            )
        else:
            return ""
        if not self.secret:
            self.sock.send_multipart([identity, encode(Shutdown(why))])
            raise RuntimeError(why)
        return why
