"""The coordinator's engine: tokenizer, scheduler, block manager and the step loop that drives the workers."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

from coordinator.block_manager import BlockManager
from coordinator.config import EngineConfig
from coordinator.detokenizer import decode_delta
from coordinator.prompts import generation_defaults, render_chat
from coordinator.scheduler import ScheduledBatch, Scheduler
from coordinator.sequence import SeqStatus, Sequence
from coordinator.worker_group import WorkerGroup
from model.config import ModelConfig
from protocol.client_messages import ChatPrompt
from protocol.errors import RequestError
from protocol.messages import StepResult, WorkerConfig
from protocol.outputs import Completion
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


@dataclass(slots=True)
class StepOutput:
    """What one step changed, for streaming: a sequence and the tokens and text it gained."""

    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    finished: bool
    new_logprobs: list[dict[int, float]] | None = None  # one dict per new token, when the request asked


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        from transformers import AutoTokenizer

        if not cfg.model:
            from model.tiny import default_model_dir

            cfg.model = str(default_model_dir())
        _setup_logging()
        self.config = cfg
        self.model_config = ModelConfig.from_pretrained(cfg.model)  # fails fast, before any process starts
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.generation_defaults = generation_defaults(cfg.model)  # for requests that leave them unset
        mc = self.model_config
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = set(mc.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        worker_config = WorkerConfig(
            model=cfg.model,
            device=cfg.device,
            dtype=cfg.dtype,
            load_format=cfg.load_format,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_kv_blocks=cfg.num_kv_blocks or -1,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            attention_backend=cfg.attention_backend,
            dist_init_method="",
        )
        self.workers = WorkerGroup(
            worker_config,
            cfg.tensor_parallel_size,
            external=cfg.external_workers,
            address=cfg.worker_address,
            start_timeout_s=cfg.worker_timeout_s,
        )
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
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            async_scheduling=cfg.async_scheduling,
            eos_token_ids=frozenset(t for t in self.eos_token_ids if 0 <= t < self.vocab_size),
        )
        self._in_flight: deque[ScheduledBatch] = deque()  # sent, results not applied yet (oldest first)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens_computed = 0
        self.num_output_tokens = 0
        self.closed = False
        # Keep start-up objects (the tokenizer, transformers, one Block per KV block) out of every later full
        # collection: one took ~100 ms when 256 requests arrived at once (docs/PERF.md log 9g).
        gc.collect()
        gc.freeze()

    # ---- requests ----------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int] | ChatPrompt) -> list[int]:
        if isinstance(prompt, ChatPrompt):  # the template's text carries its own special tokens
            prompt = render_chat(self.tokenizer, prompt)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        # type/min/max run at C speed: W1's 256 prompts (143k ids) were ~10 ms of per-id Python checks
        if isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:
            if prompt and not (min(prompt) >= 0 and max(prompt) < self.vocab_size):
                bad = [t for t in prompt if not 0 <= t < self.vocab_size]
                raise RequestError(f"prompt token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
            return list(prompt)
        raise RequestError("prompt must be a string or a list of token ids")

    def add_request(
        self, prompt: str | list[int] | ChatPrompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Sequence:
        """Validate and queue a request. Raises RequestError naming the problem; nothing is queued then."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params must be a SamplingParams")
        try:
            params.validate()  # again: the dataclass is mutable after construction
        except ValueError as e:
            raise RequestError(str(e)) from None
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestError("prompt is empty")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise RequestError(
                f"prompt + max_tokens = {total} tokens needs more KV blocks than the pool has "
                f"({self.block_manager.num_blocks} x {self.block_manager.block_size} tokens)"
            )
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise RequestError(f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        seq = Sequence(request_id, ids, len(ids), params, time.monotonic())
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        return seq

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._in_flight)

    # ---- the step ----------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Advance the engine by one step and return what it changed.

        With async scheduling, step N+1 (up to N + async_depth) is scheduled and sent before step N's tokens
        are read back, so the workers go straight from one step to the next while this process applies
        results, checks stop conditions and detokenizes. A sequence that stops at step N may already be in the
        steps after it: those extra tokens are dropped."""
        batch = self.scheduler.schedule()
        if not self.config.async_scheduling:
            if batch is None:
                return []
            return self._apply(batch, self.workers.run_step(batch.step))
        if batch is not None:
            self.workers.send_step(batch.step)
            self._in_flight.append(batch)
        # read the oldest result once more than async_depth steps are out, or when nothing new could be sent
        if self._in_flight and (len(self._in_flight) > self.config.async_depth or batch is None):
            done = self._in_flight.popleft()
            return self._apply(done, self.workers.recv_result(done.step.step_id))
        return []

    def _apply(self, batch: ScheduledBatch, result: StepResult) -> list[StepOutput]:
        tokens = result.token_ids.tolist()
        self.num_prompt_tokens_computed += sum(n for n in batch.num_tokens if n > 1)
        self.num_output_tokens += len(tokens)
        lp_ids = lp_values = None
        if result.logprob_token_ids is not None:
            lp_ids, lp_values, offset = result.logprob_token_ids.tolist(), result.logprobs.tolist(), 0
        outputs = []
        for seq, token in zip(batch.sampled, tokens):
            logprobs = None
            if seq.params.logprobs is not None and lp_ids is not None:
                # the sampled token, then the top N: 1 + N entries for every sampled row that asked
                end = offset + 1 + seq.params.logprobs
                logprobs = dict(zip(lp_ids[offset:end], lp_values[offset:end]))
                offset = end
            if seq.status is SeqStatus.FINISHED:
                continue  # aborted, or stopped one step earlier
            if seq.num_pending:
                seq.resolve_pending(token)
            else:
                seq.token_ids.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            reason = self._check_stop(seq, token)
            new_text = self._update_text(seq) if self._wants_text(seq) else ""
            if reason in (None, "length") and seq.params.stop:  # a stop string on the last token still counts
                reason = self._check_stop_strings(seq) or reason
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
                # now, while the workers run the steps already sent, rather than for every request at the end
                seq.final_text = self._text(seq)
            new_logprobs = None if logprobs is None else [logprobs]
            outputs.append(StepOutput(seq, [token], new_text, reason is not None, new_logprobs))
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        num_output = seq.num_known_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
        if num_output >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
            return "length"
        return None

    def _wants_text(self, seq: Sequence) -> bool:
        return seq.stream or bool(seq.params.stop)

    def _update_text(self, seq: Sequence) -> str:
        out = seq.output_token_ids
        delta, seq.text_prefix_offset, seq.text_read_offset = decode_delta(
            self.tokenizer, out, seq.text_prefix_offset, seq.text_read_offset
        )
        seq.text += delta
        return delta

    def _check_stop_strings(self, seq: Sequence) -> str | None:
        if seq.num_known_tokens - seq.num_prompt_tokens < seq.params.min_tokens:
            return None
        for stop in seq.params.stop:
            idx = seq.text.find(stop)
            if idx >= 0:
                seq.text = seq.text[:idx]
                seq.stop_reason = stop
                return "stop"
        return None

    def _text(self, seq: Sequence) -> str:
        # a stop string cut .text short; otherwise decode once (most requests never need .text earlier)
        return seq.text if isinstance(seq.stop_reason, str) else self.decode(seq.output_token_ids)

    def completion(self, seq: Sequence) -> Completion:
        text = seq.final_text if seq.final_text is not None else self._text(seq)
        return Completion(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            text=text,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stats(self) -> dict:
        s = self.scheduler.stats
        return {
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

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.workers.shutdown()
            gc.unfreeze()  # let the interpreter's last collection reach the start-up objects again
