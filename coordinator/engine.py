"""The coordinator's engine: tokenizer, scheduler, block manager, output processor and the step loop that drives the
workers (a request's preparation before it is queued: coordinator/admission.py; its stop: Sequence.token_stop; a
step's result applied: coordinator/step_apply.py; n-gram drafts, when speculative_config is set: the scheduler's
coordinator/spec_schedule.py).

Its interface is narrow; ``LLM`` (nanoserve/llm.py) and the server (coordinator/server.py) use nothing else:
``add_request`` (or ``admit`` on any thread, then ``add_admitted``) / ``abort`` / ``step`` (returns
``StepOutput``s) / ``has_unfinished`` / ``stats`` / ``info`` / ``health`` / ``tokenize`` / ``detokenize`` (both
thread-safe) / ``shutdown``."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import time
from collections import deque

from coordinator.admission import Admission, Prepared
from coordinator.block_manager import BlockManager
from coordinator.config import EngineArgError, EngineConfig
from coordinator.output_processor import OutputProcessor
from coordinator.prompts import configured_generation_defaults, detokenize_reply, eos_token_ids, tokenize_reply
from coordinator.scheduler import ScheduledBatch, Scheduler
from coordinator.sequence import SeqStatus, Sequence
from coordinator.spec_schedule import Speculator
from coordinator.speculative import SpeculativeConfig, SpeculativeConfigError, check_startable
from coordinator.step_apply import ResultApplier
from coordinator.structured_outputs import Grammars
from coordinator.tokenizer_loader import load_tokenizer
from coordinator.worker_group import WorkerGroup
from model.config import ModelConfig
from protocol.client_messages import ChatPrompt, Detokenize, DetokenizeReply, Tokenize, TokenizeReply
from protocol.errors import EngineDeadError, RequestError
from protocol.outputs import StepOutput
from protocol.sampling_params import SamplingParams

log = logging.getLogger("nanoserve.engine")


def _setup_logging() -> None:
    """nanoserve's own INFO lines go to stderr unless the application configured logging itself."""
    root = logging.getLogger("nanoserve")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


class Engine(ResultApplier):
    def __init__(self, cfg: EngineConfig, workers: WorkerGroup | None = None) -> None:
        """``workers``: spawned early by the caller (nanoserve/serve.py: they import while this process does)."""
        if not cfg.model:
            from model.tiny import default_model_dir

            cfg.model = str(default_model_dir())
        _setup_logging()
        cfg.check_local_gpus()
        self.config = cfg
        self.model_config = ModelConfig.from_pretrained(cfg.model)  # fails fast, before any process starts
        cfg.fit_model(self.model_config)  # max_model_len resolved in the config itself: one value, reported and kept
        mc = self.model_config
        self.max_model_len = cfg.max_model_len
        mc.check_max_model_len(self.max_model_len)
        self.speculative = _speculative(cfg, mc)  # before any process starts: a draft that does not fit is refused
        self.vocab_size = mc.vocab_size
        # The workers get their config first and load weights while this process imports transformers and loads
        # the tokenizer: on a GPU host that import alone took 8-15 s, all of it ahead of the config before (log 53c).
        worker_cfg = cfg.worker_config(self.max_model_len)
        self.workers = (WorkerGroup if workers is None else workers.adopt)(
            dataclasses.replace(worker_cfg, draft_model=_draft_dir(self.speculative)),
            cfg.tensor_parallel_size,
            external=cfg.external_workers,
            address=cfg.worker_address,
            start_timeout_s=cfg.worker_timeout_s,
            secret=cfg.worker_secret,
        )
        try:
            self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
            if cfg.chat_template:  # every chat renders through it: LLM.chat, the client's chat and the HTTP API
                self.tokenizer.chat_template = cfg.chat_template
            # for requests that leave them unset (admission applies them)
            self.generation_defaults = configured_generation_defaults(cfg.generation_config, cfg.model)
            self.eos_token_ids = eos_token_ids(mc.eos_token_id, self.tokenizer)
        except BaseException:
            self.workers.shutdown()
            raise
        eos_ids = sorted(t for t in self.eos_token_ids if 0 <= t < self.vocab_size)
        self.workers.allocate(eos_ids)
        w = self.workers
        log.info(
            "KV cache on %s: %d blocks x %d tokens = %.2f GiB per rank, %d tokens at once",
            w.device_name,
            w.num_kv_blocks,
            cfg.block_size,
            w.num_kv_blocks * w.kv_block_bytes / 2**30,
            w.num_kv_blocks * cfg.block_size,
        )
        self.block_manager = BlockManager(w.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.admission = Admission(
            self.tokenizer, self.max_model_len, self.vocab_size, self.block_manager, self.generation_defaults
        )
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            async_scheduling=cfg.async_scheduling,
            max_prefill_beside_decodes=cfg.max_prefill_beside_decodes,
            speculator=Speculator(self.speculative, self.max_model_len) if self.speculative else None,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, eos_ids)
        self.num_constrained = 0  # unfinished requests with structured outputs: only then a step builds masks
        self._in_flight: deque[ScheduledBatch] = deque()  # sent, results not applied yet (oldest first)
        self.requests: dict[str, Sequence] = {}  # unfinished requests
        self._ids = itertools.count()
        self.num_prompt_tokens_computed = 0
        self.num_output_tokens = 0
        self.closed = False
        # Keep start-up objects (the tokenizer, transformers, one Block per KV block) out of every later full
        # collection: one took ~100 ms when 256 requests arrived at once. Launch (nanoserve/serve.py) froze its
        # imports and turned collection off: it has ~400 unreachable objects to gain for 70-90 ms of its start-up.
        if gc.isenabled():
            gc.collect()
        gc.freeze()

    # ---- requests ----------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | ChatPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stream: bool = False,
    ) -> str:
        """Prepare (coordinator/admission.py) and queue a request; returns its id (RequestError naming the problem:
        nothing queued). A streamed request gets a StepOutput every step it gains tokens in, others one at the end."""
        if isinstance(params, SamplingParams):  # the in-process entry: the record may have changed since it was built
            try:  # (a client's records are checked where they arrive: coordinator/client_frames.py)
                params.validate()
            except ValueError as e:
                raise RequestError(str(e)) from None
        return self.add_admitted(*self.admit(prompt, params), request_id, stream)

    def admit(self, prompt: str | list[int] | ChatPrompt, params: SamplingParams | None) -> Prepared:
        """``add_request``'s first half, the slow one (template, tokenizer): thread-safe, changes nothing here."""
        return self.admission.admit(prompt, params)

    def add_admitted(self, ids: list[int], params: SamplingParams, request_id: str | None, stream: bool) -> str:
        """``add_request``'s second half: queue what ``admit`` returned (RequestError for a duplicate id or a
        structured-outputs spec that does not parse)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        seq = Sequence(request_id, ids, len(ids), params, time.monotonic())
        constrained = params.structured_outputs is not None
        # RequestError if its spec does not parse; a grammar still compiling is scheduled once it has compiled
        ready = self.grammars.attach(seq) if constrained else True
        seq.every_token = self.output_processor.add(seq, stream)
        self.requests[request_id] = seq
        self.num_constrained += constrained
        if ready:
            self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> StepOutput | None:
        """End an unfinished request (its blocks and slot are freed); returns its last output, or None when no
        such request is unfinished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.num_constrained -= seq.params.structured_outputs is not None
        if not self.grammars.drop(request_id):
            self.scheduler.finish(seq, "abort")
        else:  # never scheduled
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        return self.output_processor.finish(seq, "abort")

    @property
    def has_unfinished(self) -> bool:
        """Requests to run or steps in flight: ``step`` has work."""
        return self.scheduler.has_work or bool(self._in_flight) or bool(self.grammars.pending)

    # ---- the step ----------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Advance the engine by one step and return the output processor's outputs of it.

        With async scheduling, step N+1 (up to N + async_depth) is scheduled and sent before step N's tokens
        are read back, so the workers go straight from one step to the next while this process applies
        results, checks stop conditions and detokenizes. A sequence that stops at step N may already be in the
        steps after it: those extra tokens are dropped."""
        outputs = self._admit_compiled() if self.grammars.pending else []  # a failed compile ends its request
        # a sequence in a verify row in flight waits for its result: read it now, not async_depth steps later
        while any(b.drafts is not None for b in self._in_flight):
            outputs += self._read_oldest()
        batch = self.scheduler.schedule()
        if batch is not None and self.num_constrained:  # bitmasks need every earlier token
            self.grammars.add_masks(batch, later=bool(self._in_flight))
        if not self.config.async_scheduling:
            return outputs + (self.apply_result(batch, self.workers.run_step(batch.step)) if batch is not None else [])
        if batch is not None:
            self.workers.send_step(batch.step)
            self._in_flight.append(batch)
        # read the oldest result once more than async_depth steps are out, or when nothing new could be sent
        if self._in_flight and (len(self._in_flight) > self.config.async_depth or batch is None):
            outputs += self._read_oldest()
        return outputs

    def _read_oldest(self) -> list[StepOutput]:
        done = self._in_flight.popleft()
        outputs = self.apply_result(done, self.workers.recv_result(done.step.step_id))
        if (due := self.grammars.due_masks(self._in_flight)) is not None:
            self.workers.send_masks(due)
        return outputs

    def _admit_compiled(self) -> list[StepOutput]:
        """Requests whose grammar has compiled join the scheduler; one whose compile failed ends ("abort")."""
        ready, failed = self.grammars.compiled(idle=not (self.scheduler.has_work or self._in_flight))
        for seq in ready:
            self.scheduler.add(seq)
        return [out for seq in failed if (out := self.abort(seq.request_id)) is not None]

    # ---- state -------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        s, spec = self.scheduler.stats, self.scheduler.speculator
        return {
            **(spec.stats.as_dict(spec.cfg.num_speculative_tokens) if spec else {}),
            "steps": s.steps,
            "preemptions": s.preemptions,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "chunked_prefill_steps": s.chunked_prefill_steps,
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "prompt_tokens": self.num_prompt_tokens_computed,
            "output_tokens": self.num_output_tokens,
        }

    def info(self) -> dict:
        """What is served, how: the fields of the client protocol's InfoReply."""
        cfg, bm = self.config, self.block_manager
        return {
            "model": cfg.model,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "device": cfg.device,
            "vocab_size": self.vocab_size,
            "block_size": bm.block_size,
            "kv_blocks_total": bm.num_blocks,
            "kv_capacity_tokens": bm.num_blocks * bm.block_size,
            "max_num_seqs": cfg.max_num_seqs,
            "worker_pids": [p.pid for p in self.workers.procs],
            "coordinator_pid": os.getpid(),
            "generation_defaults": self.generation_defaults,
        }

    def tokenize(self, msg: Tokenize) -> TokenizeReply:
        """Answer a Tokenize request (RequestError names the problem); thread-safe, as ``detokenize``."""
        return tokenize_reply(self.tokenizer, self.max_model_len, msg, self.admission.max_tokenize_chars)

    def detokenize(self, msg: Detokenize) -> DetokenizeReply:
        """Answer a Detokenize request (RequestError for ids outside the vocabulary)."""
        return detokenize_reply(self.tokenizer, self.vocab_size, msg, self.output_processor.token_texts)

    def health(self) -> None:
        """Returns when the engine can serve; raises EngineDeadError naming the problem otherwise (a worker died,
        or the engine was shut down)."""
        if self.closed:
            raise EngineDeadError("the engine was shut down")
        self.workers.check_alive()

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.grammars.close()
            self.workers.shutdown()
            gc.unfreeze()  # let the interpreter's last collection reach the start-up objects again


def _draft_dir(spec: SpeculativeConfig | None) -> str:
    return spec.model if spec is not None and spec.method == "eagle3" else ""


def _speculative(cfg: EngineConfig, target: ModelConfig) -> SpeculativeConfig | None:
    if cfg.speculative_config is None:
        return None
    try:
        spec = check_startable(SpeculativeConfig.from_dict(cfg.speculative_config), target, cfg.download_dir)
    except SpeculativeConfigError as e:
        raise EngineArgError("speculative_config", str(e)) from None
    return spec
