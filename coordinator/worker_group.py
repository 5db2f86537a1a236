"""The coordinator's side of the worker processes: spawn (or accept) them, handshake (authenticating each with
the worker secret, where there is one), broadcast each step over ZMQ and collect the sampled tokens, and notice
when any of them dies or hangs. Only an accepted worker's messages are ever read: any other peer is logged once
and ignored, for the whole run."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import zmq

from coordinator import private_dirs
from coordinator.worker_admission import WorkerAdmission, peer_address
from protocol.codec import ProtocolError, decode, encode
from protocol.errors import EngineDeadError
from protocol.messages import (
    AllocateKV,
    Shutdown,
    StepCommand,
    StepMasks,
    StepResult,
    WorkerAck,
    WorkerConfig,
    WorkerError,
    WorkerReady,
)
from protocol.transport import WatchedSocket

log = logging.getLogger("nanoserve.workers")
ROOT = Path(__file__).resolve().parent.parent
POLL_MS = 200
# a worker told to stop finishes its steps in flight, then tears down torch: seconds on a busy host; kill only a hang
EXIT_GRACE_S = 30.0
PROBE_AFTER_DROP_S = 5.0  # how long a dropped connection is checked against each accepted worker at every poll


class WorkerGroup(WorkerAdmission):
    def __init__(
        self,
        worker_config: WorkerConfig | None,  # None: spawn only; ``adopt`` sends the config later
        world_size: int,
        external: bool = False,
        address: str = "",
        start_timeout_s: float = 120.0,
        step_timeout_s: float = 600.0,
        secret: str = "",
    ) -> None:
        self.world_size = world_size
        self.secret = secret
        self.step_timeout_s, self.start_timeout_s = step_timeout_s, start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.tmpdir = private_dirs.create()  # the next start removes it if this process is killed
        self.ctx = zmq.Context()
        # a dropped worker connection (process killed, host gone) is an engine death, not a silent wait; another
        # peer's (a refused impostor) is not: a drop is checked against each accepted worker (``_probe``)
        self.channel = WatchedSocket(self.ctx, zmq.ROUTER, linger_ms=0)
        self._drops_seen, self._next_probe, self._suspect_until = 0, 0.0, 0.0
        self.sock = self.channel.sock
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises, not vanishes
        # each rank's identity once accepted; workers pick random ones, so nobody can take a rank's name first
        self.identities: list[bytes] = []
        self._rank_of: dict[bytes, int] = {}  # accepted identity -> rank
        self._ignored: set[bytes] = set()  # identities refused or unknown: their messages are ignored
        self._noted: set[bytes] = set()  # ... and logged, once per identity
        self.dead = False
        self._results: dict[int, dict[int, StepResult]] = {}  # step id -> rank -> result
        try:
            if external:
                if not address:
                    raise ValueError("external workers need worker_address, e.g. tcp://0.0.0.0:29600")
                self._bind(address)
                self.address = address
            else:
                self.address = f"ipc://{self.tmpdir}/workers"
                self._bind(self.address)
                self._spawn()
            if worker_config is not None:
                self._send_config(worker_config)
        except BaseException:
            self.shutdown()
            raise

    def adopt(
        self, worker_config: WorkerConfig, world_size: int, external: bool = False, address: str = "",
        start_timeout_s: float = 120.0, step_timeout_s: float = 600.0, secret: str = "",
    ) -> WorkerGroup:  # fmt: skip
        """The config for a group spawned without one (its workers imported torch meanwhile), for an engine whose
        arguments (the constructor's) must be those it was spawned with."""
        try:
            if (world_size, external, secret) != (self.world_size, False, self.secret) or not self.procs:
                raise ValueError("the workers spawned early do not match the engine's arguments")
            self.step_timeout_s, self.start_timeout_s = step_timeout_s, start_timeout_s
            self._send_config(worker_config)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _bind(self, address: str) -> None:
        try:
            self.sock.bind(address)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind worker endpoint {address}: {e}") from None

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        # the secret travels in the environment, never in argv (which any local user can read)
        env.pop("NANOSERVE_WORKER_SECRET", None)
        env.pop("NANOSERVE_API_KEY", None)
        if self.secret:
            env["NANOSERVE_WORKER_SECRET"] = self.secret
        for rank in range(self.world_size):
            cmd = [sys.executable, "-m", "worker", "--coordinator", self.address, "--rank", str(rank)]
            cmd += ["--world-size", str(self.world_size), "--local-rank", str(rank), "--parent-pid", str(os.getpid())]
            self.procs.append(subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL))

    # ---- receiving ---------------------------------------------------------------------------------------

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                self.dead = True
                raise EngineDeadError(f"worker rank {rank} (pid {proc.pid}) exited with code {code}")

    def _recv(self, deadline: float, what: str, pending: set[int], strangers: bool = False):
        """(identity, message, peer address) of the next message from an accepted worker (with ``strangers``, from
        any peer not yet refused); raises with the ranks still missing when ``deadline`` passes."""
        while True:
            has_message, _ = self.channel.poll(POLL_MS)
            if self.channel.drops != self._drops_seen or (not has_message and time.monotonic() > self._next_probe):
                self._probe()
            if has_message:
                identity = self.sock.recv()
                rank = self._rank_of.get(identity)
                # an accepted worker's frame is plain bytes; anyone else's keeps its sender's address for the log
                frame = self.sock.recv(copy=rank is not None)
                peer = "" if rank is not None else peer_address(frame)
                extra = self.sock.getsockopt(zmq.RCVMORE) and self.sock.recv_multipart()
                if identity in self._ignored or (rank is None and not strangers) or extra:
                    self._ignore(identity, peer, "not an accepted worker")
                    continue
                try:
                    msg = decode(frame if rank is not None else frame.bytes)
                except ProtocolError as e:
                    if rank is None:
                        self._ignore(identity, peer, f"undecodable frame: {e}")
                    else:
                        log.warning("dropping an undecodable frame from worker rank %d: %s", rank, e)
                    continue
                if rank is not None and isinstance(msg, WorkerError):
                    self.dead = True
                    raise EngineDeadError(f"worker rank {rank} failed: {msg.message}")
                return identity, msg, peer
            self.check_alive()
            if time.monotonic() > deadline:
                self.dead = True
                raise TimeoutError(f"timed out waiting for {what} from worker rank(s) {sorted(pending)}")

    def _probe(self) -> None:
        """Raise if an accepted worker's connection is gone. The socket's monitor says a connection dropped, not
        whose: an empty frame (workers skip it) to each accepted worker fails once ZMQ has dropped its pipe, which
        follows the drop within moments (later on a loaded host): so this runs at each drop, then at each idle poll
        for a few seconds, then once a second while idle."""
        now = time.monotonic()
        if self.channel.drops != self._drops_seen:
            self._suspect_until = now + PROBE_AFTER_DROP_S
        self._drops_seen = self.channel.drops
        self._next_probe = now + (0.0 if now < self._suspect_until else 1.0)
        for identity, rank in self._rank_of.items():
            try:
                self.sock.send_multipart([identity, b""], zmq.NOBLOCK)
            except zmq.Again:
                pass  # its queue is full: it is there, busy
            except zmq.ZMQError:
                self.dead = True
                raise EngineDeadError(
                    f"worker rank {rank}'s connection dropped (process exited or host unreachable)"
                ) from None

    def _gather(self, kind: type, timeout_s: float, what: str) -> dict[int, object]:
        pending, got = set(range(self.world_size)), {}
        deadline = time.monotonic() + timeout_s
        while pending:
            identity, msg, _ = self._recv(deadline, what, pending)
            if not isinstance(msg, kind) or msg.rank != self._rank_of[identity]:
                raise EngineDeadError(f"protocol error: expected {kind.__name__}, got {type(msg).__name__}")
            got[msg.rank] = msg
            pending.discard(msg.rank)
        return got

    # ---- start-up ----------------------------------------------------------------------------------------

    def _send_config(self, worker_config: WorkerConfig) -> None:
        """Admit every rank and send it the config: it loads weights and sizes its pool while the engine loads
        the tokenizer; ``allocate`` finishes the start."""
        if self.procs:  # ours: they meet in our private dir (torchrun's use its environment)
            worker_config.dist_init_method = f"file://{self.tmpdir}/dist-store"
        self._admit_workers(time.monotonic() + self.start_timeout_s)
        self._broadcast(encode(worker_config))

    def allocate(self, eos_token_ids: list[int]) -> None:
        """The rest of the start: each rank's pool size, the smallest allocated everywhere with the model's EOS ids,
        every rank ready for steps (or the group shut down and the error raised)."""
        try:
            self._allocate(eos_token_ids)
        except BaseException:
            self.shutdown()
            raise

    def _allocate(self, eos_token_ids: list[int]) -> None:
        ready = self._gather(WorkerReady, self.start_timeout_s, "weights loaded (WorkerReady)")
        self.num_kv_blocks = min(r.num_kv_blocks for r in ready.values())
        self.kv_block_bytes = ready[0].kv_block_bytes
        self.device_name = ready[0].device_name
        if self.num_kv_blocks <= 0:
            raise RuntimeError("no memory left for the KV cache: lower the model size or raise gpu_memory_utilization")
        self._broadcast(encode(AllocateKV(self.num_kv_blocks, eos_token_ids)))
        self._gather(WorkerAck, self.start_timeout_s, "KV allocation")
        log.info(
            "%d worker(s) ready: %d KV blocks of %d bytes", self.world_size, self.num_kv_blocks, self.kv_block_bytes
        )

    # ---- steps -------------------------------------------------------------------------------------------

    def _broadcast(self, data: bytes, ranks: int | None = None) -> None:
        for identity in self.identities[:ranks]:
            try:
                self.sock.send_multipart([identity, data])
            except zmq.ZMQError as e:
                self.dead = True
                raise EngineDeadError(f"worker {identity.decode()} is unreachable: {e}") from None

    def send_step(self, step: StepCommand) -> None:
        if self.dead:
            raise EngineDeadError("the worker group is dead")
        self._broadcast(encode(step))

    def send_masks(self, masks: StepMasks) -> None:
        """A step's late token bitmasks, to rank 0 (the only rank that samples a masked step)."""
        if self.dead:
            raise EngineDeadError("the worker group is dead")
        self._broadcast(encode(masks), ranks=1)

    def recv_result(self, step_id: int) -> StepResult:
        """Rank 0's result (sampled token ids, logprobs) for ``step_id``, once every rank has finished that step."""
        # with steps pipelined, a fast rank may answer step N+1 before a slow one answers step N
        deadline = time.monotonic() + self.step_timeout_s
        got = self._results.setdefault(step_id, {})
        while len(got) < self.world_size:
            identity, msg, _ = self._recv(deadline, f"step {step_id}", set(range(self.world_size)) - set(got))
            if not isinstance(msg, StepResult):
                raise EngineDeadError(f"protocol error: expected StepResult, got {type(msg).__name__}")
            self._results.setdefault(msg.step_id, {})[self._rank_of[identity]] = msg
        return self._results.pop(step_id)[0]

    def run_step(self, step: StepCommand) -> StepResult:
        """Broadcast one step and wait for its result."""
        self.send_step(step)
        return self.recv_result(step.step_id)

    def shutdown(self) -> None:
        if not self.sock.closed:
            for identity in self._rank_of:  # every accepted worker, the start-up done or not
                try:
                    self.sock.send_multipart([identity, encode(Shutdown("coordinator shutting down"))], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + EXIT_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.channel.close(linger_ms=500)  # let the Shutdown frames reach workers we have no process handle for
        self.ctx.term()
        private_dirs.remove(self.tmpdir)
