"""The coordinator's side of the worker processes: spawn (or accept) them, handshake, broadcast each step
over ZMQ and collect the sampled tokens, and notice when any of them dies or hangs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import zmq

from coordinator import private_dirs
from protocol.codec import ProtocolError, decode, encode
from protocol.errors import EngineDeadError
from protocol.messages import (
    PROTOCOL_VERSION,
    AllocateKV,
    Shutdown,
    StepCommand,
    StepMasks,
    StepResult,
    WorkerAck,
    WorkerConfig,
    WorkerError,
    WorkerHello,
    WorkerReady,
)
from protocol.transport import WatchedSocket

log = logging.getLogger("nanoserve.workers")
ROOT = Path(__file__).resolve().parent.parent
POLL_MS = 200


class WorkerGroup:
    def __init__(
        self,
        worker_config: WorkerConfig,
        world_size: int,
        external: bool = False,
        address: str = "",
        start_timeout_s: float = 120.0,
        step_timeout_s: float = 600.0,
    ) -> None:
        self.world_size = world_size
        self.step_timeout_s = step_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.tmpdir = private_dirs.create()  # the next start removes it if this process is killed
        self.ctx = zmq.Context()
        # a dropped worker connection (process killed, host gone) is an engine death, not a silent wait
        self.channel = WatchedSocket(self.ctx, zmq.ROUTER, linger_ms=0)
        self.sock = self.channel.sock
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises, not vanishes
        self.identities = [f"rank{r}".encode() for r in range(world_size)]
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
                worker_config.dist_init_method = f"file://{self.tmpdir}/dist-store"
                self._spawn()
            self._handshake(worker_config, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _bind(self, address: str) -> None:
        try:
            self.sock.bind(address)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind worker endpoint {address}: {e}") from None

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
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

    def _recv(self, deadline: float, what: str, pending: set[int]):
        """One message from any worker; raises with the ranks still missing when ``deadline`` passes."""
        while True:
            has_message, dropped = self.channel.poll(POLL_MS)
            if dropped:
                self.dead = True
                raise EngineDeadError("a worker's connection dropped (process exited or host unreachable)")
            if has_message:
                identity, data = self.sock.recv_multipart()
                try:
                    msg = decode(data)
                except ProtocolError as e:
                    log.warning("dropping undecodable frame from %r: %s", identity, e)
                    continue
                if isinstance(msg, WorkerError):
                    self.dead = True
                    raise EngineDeadError(f"worker rank {msg.rank} failed: {msg.message}")
                return identity, msg
            self.check_alive()
            if time.monotonic() > deadline:
                self.dead = True
                raise TimeoutError(f"timed out waiting for {what} from worker rank(s) {sorted(pending)}")

    def _gather(self, kind: type, timeout_s: float, what: str) -> dict[int, object]:
        pending, got = set(range(self.world_size)), {}
        deadline = time.monotonic() + timeout_s
        while pending:
            _, msg = self._recv(deadline, what, pending)
            if not isinstance(msg, kind):
                raise EngineDeadError(f"protocol error: expected {kind.__name__}, got {type(msg).__name__}")
            got[msg.rank] = msg
            pending.discard(msg.rank)
        return got

    # ---- start-up ----------------------------------------------------------------------------------------

    def _handshake(self, worker_config: WorkerConfig, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.world_size))
        while pending:
            identity, msg = self._recv(deadline, "hello", pending)
            if not isinstance(msg, WorkerHello):
                continue
            if msg.protocol_version != PROTOCOL_VERSION:
                self.sock.send_multipart([identity, encode(Shutdown("protocol version mismatch"))])
                raise RuntimeError(
                    f"protocol version mismatch: worker rank {msg.rank} speaks {msg.protocol_version}, "
                    f"coordinator speaks {PROTOCOL_VERSION}"
                )
            if msg.world_size != self.world_size or not 0 <= msg.rank < self.world_size:
                self.sock.send_multipart([identity, encode(Shutdown("world size mismatch"))])
                raise RuntimeError(
                    f"worker rank {msg.rank} joined a world of size {msg.world_size}; this coordinator expects "
                    f"tensor_parallel_size={self.world_size}"
                )
            pending.discard(msg.rank)
        self._broadcast(encode(worker_config))
        ready = self._gather(WorkerReady, timeout_s, "weights loaded (WorkerReady)")
        self.num_kv_blocks = min(r.num_kv_blocks for r in ready.values())
        self.kv_block_bytes = ready[0].kv_block_bytes
        self.device_name = ready[0].device_name
        if self.num_kv_blocks <= 0:
            raise RuntimeError("no memory left for the KV cache: lower the model size or raise gpu_memory_utilization")
        self._broadcast(encode(AllocateKV(self.num_kv_blocks)))
        self._gather(WorkerAck, timeout_s, "KV allocation")
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
            _, msg = self._recv(deadline, f"step {step_id}", set(range(self.world_size)) - set(got))
            if not isinstance(msg, StepResult):
                raise EngineDeadError(f"protocol error: expected StepResult, got {type(msg).__name__}")
            self._results.setdefault(msg.step_id, {})[msg.rank] = msg
        return self._results.pop(step_id)[0]

    def run_step(self, step: StepCommand) -> StepResult:
        """Broadcast one step and wait for its result."""
        self.send_step(step)
        return self.recv_result(step.step_id)

    def shutdown(self) -> None:
        if not self.sock.closed:
            for identity in self.identities:
                try:
                    self.sock.send_multipart([identity, encode(Shutdown("coordinator shutting down"))], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.channel.close(linger_ms=500)  # let the Shutdown frames reach workers we have no process handle for
        self.ctx.term()
        private_dirs.remove(self.tmpdir)
