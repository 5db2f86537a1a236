"""The worker process: one per device. Connects to the coordinator over ZMQ, loads its weight shard, sizes
and allocates its KV pool, then executes step commands until told to stop or until its coordinator is gone."""

from __future__ import annotations

import gc
import os
import secrets
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from protocol.codec import ProtocolError, decode, encode
from protocol.messages import (
    PROTOCOL_VERSION,
    AllocateKV,
    Shutdown,
    StepCommand,
    StepMasks,
    StepResult,
    WorkerAck,
    WorkerConfig,
    WorkerHello,
    WorkerReady,
)
from protocol.transport import WatchedSocket
from protocol.worker_auth import new_nonce
from settings.env import distributed_env, settings
from settings.startup_phases import PHASES
from worker.handshake import Refused, authenticate, exit_when_orphaned

POLL_MS = 1000


class CoordinatorGone(Exception):
    pass


class CoordinatorUnreachable(Exception):
    pass


class Worker:
    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        local_rank: int,
        parent_pid: int,
        connect_timeout_s: float = 60.0,
        secret: str | None = None,
    ) -> None:
        self.rank, self.world_size, self.local_rank, self.parent_pid = rank, world_size, local_rank, parent_pid
        self.address, self.connect_timeout_s, self.secret = address, connect_timeout_s, secret
        self.ctx = zmq.Context()
        # losing the coordinator's connection (it died, or its host did) ends this worker: no orphan holds a GPU
        self.channel = WatchedSocket(self.ctx, zmq.DEALER, linger_ms=1000, watch_handshakes=True)
        self.sock = self.channel.sock
        # a random identity: a peer that connected first under a guessable name could lock this worker out
        self.sock.setsockopt(zmq.IDENTITY, f"rank{rank}-{secrets.token_hex(8)}".encode())
        self.sock.connect(address)
        self.runner = None
        self.leaving = False  # set once the main thread is on its way out
        self.trace = None  # per-step device timing, NANOSERVE_STEP_TRACE=path

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def recv(self, wait: bool = True):
        """Next message; while waiting, notice a dead parent (spawned workers) or coordinator. Without ``wait``,
        None when no message is there (a coordinator's liveness probe, an empty frame, is skipped)."""
        while True:
            has_message, dropped = self.channel.poll(POLL_MS if wait else 0)
            if has_message:  # before the disconnect: a coordinator's last words are its Shutdown
                data = self.sock.recv()
                if data:
                    return decode(data)
                if not wait:
                    return None
                continue
            if dropped:
                raise CoordinatorGone("lost the connection to the coordinator")
            if self.parent_pid and os.getppid() != self.parent_pid:
                raise CoordinatorGone("parent process exited")
            if not wait:
                return None

    def wait_for_coordinator(self) -> None:
        """Until a coordinator completes the handshake; says where it waits, gives up after connect_timeout_s."""
        deadline = time.monotonic() + self.connect_timeout_s if self.connect_timeout_s > 0 else float("inf")
        said = False
        while True:
            has_message, dropped = self.channel.poll(POLL_MS)
            if self.channel.connected or has_message or dropped:
                return  # recv() takes it from here
            if self.parent_pid and os.getppid() != self.parent_pid:
                raise CoordinatorGone("parent process exited")
            if time.monotonic() > deadline:
                raise CoordinatorUnreachable(
                    f"no coordinator answered at {self.address} within {self.connect_timeout_s:g} s; is it running, "
                    "and can this host reach that address? (wait longer with --connect-timeout)"
                )
            if not said:  # once, and only when the coordinator was not there within the first poll
                print(f"worker rank {self.rank}: waiting for the coordinator at {self.address}", file=sys.stderr)
                said = True

    def run(self, load_modules: Callable[[], None] = lambda: None) -> int:
        """Join the coordinator, load torch and the model code (``load_modules``), then serve steps. The hello
        (and, with a secret, the challenge's answer) goes out before the imports: the coordinator admits every rank
        at once and sends the config, then loads its tokenizer while we import (log 53c)."""
        nonce = new_nonce()
        host = socket.gethostname()
        self.send(WorkerHello(PROTOCOL_VERSION, self.rank, self.world_size, "", os.getpid(), host, nonce))
        self.wait_for_coordinator()
        # with a secret a challenge comes first, answered now; without one the first message is the config
        cfg = authenticate(self, self.recv(), nonce) if self.secret else None
        PHASES.mark("hello")
        if not isinstance(cfg, Shutdown):  # a refusal needs no torch
            load_modules()
        if cfg is None:
            msg = self.recv()
            cfg = msg if self.secret else authenticate(self, msg, nonce)
        if isinstance(cfg, Shutdown):
            if cfg.reason.startswith("refused"):
                raise Refused(cfg.reason)
            return 1
        if not isinstance(cfg, WorkerConfig):
            raise ProtocolError(f"expected WorkerConfig, got {type(cfg).__name__}")
        PHASES.mark("wait config")
        import torch

        device = self._init_device_and_group(cfg)
        PHASES.mark("device + dist init")
        from comm.parallel import set_tp
        from worker import startup
        from worker.model_runner import ModelRunner

        set_tp(self.rank, self.world_size)
        if device.type == "cuda" and self.world_size > 1:
            # collective (every rank): the symmetric all-reduce buffer, before weights, KV sizing and CUDA graphs
            from comm.custom_all_reduce import init_custom_all_reduce
            from model.config import ModelConfig, parse_dtype

            mc = ModelConfig.from_pretrained(cfg.model)
            dtype = parse_dtype(cfg.dtype, mc.dtype)
            tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
            init_custom_all_reduce(tokens * mc.hidden_size * dtype.itemsize, dtype, device)
        self.runner = ModelRunner(cfg, device)
        PHASES.mark("weights")
        blocks = startup.available_kv_blocks(self.runner)
        PHASES.mark("kv sizing")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.send(WorkerReady(self.rank, blocks, self.runner.kv_block_bytes, name))
        alloc = self.recv()
        if isinstance(alloc, Shutdown):
            return 0
        if not isinstance(alloc, AllocateKV):
            raise ProtocolError(f"expected AllocateKV, got {type(alloc).__name__}")
        PHASES.mark("wait alloc")
        startup.prepare_for_steps(self.runner, alloc.num_blocks, alloc.eos_token_ids)
        trace_path = settings().step_trace
        if trace_path and self.rank == 0 and device.type == "cuda":
            from worker.step_trace import StepTrace

            self.trace = StepTrace(trace_path)
        # Move everything built so far (torch, the model, graphs) out of the collector's reach: a full collection
        # walks every tracked object and stalls the step loop meanwhile (the coordinator's took ~100 ms).
        gc.collect()
        gc.freeze()
        threading.Thread(target=exit_when_orphaned, args=(self,), name="orphan-watchdog", daemon=True).start()
        PHASES.report(f"rank {self.rank}")  # benchmarks/startup.py reads it
        self.send(WorkerAck(self.rank, "kv_allocated"))
        return self.step_loop()

    def step_loop(self) -> int:
        """Launch each step as soon as it arrives and report each step's tokens as soon as its device work is
        done (the device never waits on this loop). Finished steps are reported before the next command is
        launched: the coordinator schedules step N + 2 from step N's tokens, and launching a step with prefill
        tokens holds this loop for ~20 ms, so a report held back behind it can leave the workers without a
        queued step. A step whose token bitmasks follow (StepMasks, rank 0 only) waits after its forward: the
        coordinator builds them from the tokens of the steps before it, which this loop keeps reporting, and the
        commands behind it wait, since their inputs are its tokens."""
        from worker.results import AwaitingMasks

        self.awaiting_type = AwaitingMasks  # worker.results imports torch, loaded only once the worker has a device
        in_flight: deque = deque()
        awaiting: AwaitingMasks | None = None
        queued: deque[StepCommand] = deque()  # arrived while a step awaits its bitmasks
        while True:
            self._report(in_flight)
            while queued and awaiting is None:
                awaiting = self._launch(queued.popleft(), in_flight)
            if in_flight and not self.sock.poll(0):
                continue  # spin: a CUDA step takes milliseconds and we want to report it at once
            msg = self.recv(wait=not in_flight)
            if msg is None:
                continue
            if isinstance(msg, StepCommand):
                if awaiting is None:
                    awaiting = self._launch(msg, in_flight)
                else:
                    queued.append(msg)
            elif isinstance(msg, StepMasks):
                if awaiting is None or msg.step_id != awaiting.step_id:
                    raise ProtocolError(f"bitmasks of step {msg.step_id}, which does not await them")
                in_flight.append(awaiting.finish(msg.token_masks))
                awaiting = None
            elif isinstance(msg, Shutdown):
                # steps sent but not run here are run on unmasked logits (their tokens are dropped), so every rank
                # completes the same collectives before it leaves
                while awaiting is not None or queued:
                    if awaiting is not None:
                        awaiting.finish(None)
                        awaiting = None
                    else:
                        awaiting = self._launch(queued.popleft(), in_flight)
                if self.trace:
                    self.trace.dump()
                return 0
            else:
                raise ProtocolError(f"unexpected message {type(msg).__name__}")

    def _report(self, in_flight: deque, every: bool = False) -> None:
        """Send the results of the steps done (``every``: of all launched steps, waiting for them), in order."""
        while in_flight and (every or in_flight[0].ready()):
            done = in_flight.popleft()
            tokens = done.wait()  # before prompt_result: the prompt logprobs arrive with the tokens
            lp = (done.logprob_token_ids, done.logprobs)
            prompt = done.prompt_result()
            self.send(StepResult(done.step_id, self.rank, tokens, *lp, *prompt, num_accepted=done.num_accepted))

    def _launch(self, step: StepCommand, in_flight: deque):
        """Launch a step; returns it when it awaits its bitmasks, else queues it in ``in_flight``."""
        if self.runner.unsettled is not None:
            # the last verify step's accepted counts lay out this one, so launching waits for it anyway: report
            # it first, or the coordinator would learn its tokens only after this launch
            self._report(in_flight, every=True)
        start = self.trace.begin(time.perf_counter()) if self.trace else None
        launched = self.runner.launch(step)
        if self.trace:
            self.trace.end(start, len(step.slots), len(step.token_ids))
        if isinstance(launched, self.awaiting_type):
            return launched
        in_flight.append(launched)
        return None

    def _init_device_and_group(self, cfg: WorkerConfig):
        import torch
        import torch.distributed as dist

        if cfg.device == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
            # ranks on one host share its cores; oversubscribed intra-op threads make gloo collectives crawl
            local_world = distributed_env(world_size=self.world_size).local_world_size
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        init = cfg.dist_init_method or "env://"
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init, rank=self.rank, world_size=self.world_size, **kwargs)
        return device

    def close(self) -> None:
        import torch.distributed as dist

        self.leaving = True
        if dist.is_initialized():
            dist.destroy_process_group()
        self.channel.close(linger_ms=500)
        self.ctx.term()
        gc.unfreeze()  # let the interpreter's last collection reach the start-up objects again
