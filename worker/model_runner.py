"""Turns a step (which sequences, which tokens, where their KV lives) into flat tensors, runs the model and
samples. Per-sequence state lives in slot-indexed numpy arrays (block tables and computed lengths here, sampling
settings in worker/sampling_state.py), so every step is a handful of vectorized ops. Start-up work (KV sizing,
warm-ups, graph capture) is in worker/startup.py; a step with draft tokens (speculative decoding) is laid out and
sampled by worker/speculative.py."""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention import AttentionMetadata, value_cache
from kernels.backends import get_backend
from model.config import ModelConfig, parse_dtype
from model.context import forward_context
from model.fp8 import parse_kv_cache_dtype
from model.layers import PagedAttention
from model.loader import load_model
from protocol.messages import StepCommand, WorkerConfig
from settings.env import settings
from worker import lazy_zeros
from worker.cuda_graphs import DecodeGraphs
from worker.logprobs import PromptLogprobs
from worker.prefill_graphs import PrefillGraphs
from worker.results import AwaitingMasks, PendingTokens, ResultRing, no_tokens
from worker.sampling_state import SamplingState
from worker.speculative import SpeculativeSteps, add_verify_rows
from worker.step_layout import HostBatch
from worker.step_sampling import StepSampling
from worker.transfer import HostStager


class ModelRunner(StepSampling, SpeculativeSteps):
    def __init__(self, cfg: WorkerConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.model_config = ModelConfig.from_pretrained(cfg.model)
        self.dtype = parse_dtype(cfg.dtype, self.model_config.dtype)
        self.block_size = cfg.block_size
        torch.manual_seed(cfg.seed)
        self.model = load_model(cfg.model, device, self.dtype, cfg.load_format, cfg.seed, cfg.quantization)
        self.kv_dtype = parse_kv_cache_dtype(cfg.kv_cache_dtype, self.dtype)
        self.backend = get_backend(cfg.attention_backend, device, cfg.block_size, self.kv_dtype)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed)
        self.noise_seeds = np.random.default_rng(cfg.seed)  # per-step keys of the fused sampler's noise
        self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None  # captured by worker/startup.py
        self.prefill_graphs: PrefillGraphs | None = None
        self.last_tokens = torch.zeros(cfg.max_num_seqs, dtype=torch.int64, device=device)
        self.stager = HostStager(device)
        self.results = ResultRing(cfg.max_num_seqs, device)
        # slot-indexed sequence state
        n, width = cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_size)
        self.block_tables = np.zeros((n, width), dtype=np.int32)
        self.num_seq_blocks = np.zeros(n, dtype=np.int64)
        self.num_computed = np.zeros(n, dtype=np.int64)
        # the EOS ids come with AllocateKV (worker/startup.prepare_for_steps)
        self.sampling = SamplingState(n, self.model_config.vocab_size, (), device, self.to_dev)
        self.prompt_logprobs = PromptLogprobs()
        self.unsettled: tuple | None = None  # the last verify step's accepted counts, until the next step
        self.accept_all_drafts = settings().bench_accept_drafts  # benchmark only: speculation's ceiling
        self.step_ids: torch.Tensor | None = None  # the last forward's input ids (the EAGLE-3 draft reads them)
        self.drafter = None  # EAGLE-3 drafts (worker/eagle_drafter.py), when the coordinator named a draft model
        if cfg.draft_model:
            from worker.eagle_drafter import EagleDrafter

            self.drafter = EagleDrafter(self, cfg.draft_model)

    # ---- KV pool (sized by worker/startup.py) -----------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        layer = self.attn_layers[0]
        per_token = 2 * layer.num_kv_heads * layer.head_dim * self.kv_dtype.itemsize
        return per_token * self.block_size * len(self.attn_layers) + (self.drafter.block_bytes if self.drafter else 0)

    def allocate_kv(self, num_blocks: int) -> None:
        layer = self.attn_layers[0]
        shape = (len(self.attn_layers), 2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        self.kv_cache = lazy_zeros.zeros(shape, self.kv_dtype, self.device)  # CPU: pages committed as written
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], value_cache(self.kv_cache[i, 1])
        if self.drafter is not None:
            self.drafter.allocate(num_blocks)
        self.num_blocks = num_blocks

    # ---- one step --------------------------------------------------------------------------------------

    def to_dev(self, arr: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return self.stager.to_device(arr, dtype)

    def set_prefill_meta(self, meta: AttentionMetadata, q_lens, seq_lens, tables) -> None:
        cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        meta.cu_seqlens_q = self.to_dev(cu, torch.int32)
        meta.prefill_seq_lens = self.to_dev(seq_lens, torch.int32)
        meta.prefill_block_tables = self.to_dev(tables, torch.int32)
        meta.max_seqlen_q, meta.max_seqlen_k = int(q_lens.max()), int(seq_lens.max())

    def set_decode_meta(self, meta: AttentionMetadata, slots: np.ndarray, seq_lens: np.ndarray, width: int) -> None:
        """One decode row per entry of ``slots``, attending to its first ``seq_lens`` positions."""
        meta.decode_seq_lens = self.to_dev(seq_lens, torch.int32)
        meta.decode_block_tables = self.to_dev(self.block_tables[slots, :width], torch.int32)
        meta.max_decode_seq_len = int(seq_lens.max())

    def apply_slot_updates(self, step: StepCommand) -> None:
        """Start new sequences in their slots and append newly allocated blocks (after the last verify step's
        rows have settled to their accepted lengths)."""
        if self.unsettled is not None:
            self.settle()
        freed, new = step.freed_slots, step.new_slots
        if len(freed):
            self.num_seq_blocks[freed] = 0
            self.sampling.free(freed)
            self.prompt_logprobs.free(freed)
        if len(new):
            self.num_seq_blocks[new] = 0
            self.num_computed[new] = step.new_start_pos
            past = (step.new_num_outputs, step.new_prompt_lens, step.new_past_token_ids)
            self.sampling.start(new, step.new_params, *past)
            self.prompt_logprobs.start(new, step.new_params, *past)
        counts = step.new_block_counts
        total = int(counts.sum()) if len(counts) else 0
        if total:
            rows = np.repeat(step.slots, counts)
            group_start = np.repeat(np.cumsum(counts) - counts, counts)
            cols = np.repeat(self.num_seq_blocks[step.slots], counts) + (np.arange(total) - group_start)
            self.block_tables[rows, cols] = step.new_block_ids
            self.num_seq_blocks[step.slots] += counts

    def prepare_host(self, step: StepCommand) -> HostBatch:
        """Positions, slot mapping and lengths for one step, on the host (all vectorized)."""
        slots = step.slots.astype(np.int64)
        num_prefills = len(step.prefill_num_tokens)
        q_lens = np.ones(len(slots), dtype=np.int64)  # every row after the prefills computes one token
        q_lens[:num_prefills] = step.prefill_num_tokens
        num_tokens = int(q_lens.sum())
        start = self.num_computed[slots]
        seq_lens = start + q_lens
        cu = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        positions = np.repeat(start - cu[:-1], q_lens) + np.arange(num_tokens)
        token_rows = np.repeat(slots, q_lens)
        slot_mapping = self.block_tables[token_rows, positions // self.block_size].astype(np.int64)
        slot_mapping = slot_mapping * self.block_size + positions % self.block_size
        self.num_computed[slots] = seq_lens
        last = cu[1:] - 1
        if len(step.skip_sample_rows):
            keep = np.ones(len(slots), dtype=bool)
            keep[step.skip_sample_rows] = False
            last, sample_slots, sample_positions = last[keep], slots[keep], seq_lens[keep]
        else:
            sample_slots, sample_positions = slots, seq_lens
        hb = HostBatch(
            slots=slots,
            q_lens=q_lens,
            seq_lens=seq_lens,
            cu=cu,
            positions=positions,
            slot_mapping=slot_mapping,
            num_prefills=num_prefills,
            width=-(-int(seq_lens.max()) // self.block_size),
            sample_idx=last,
            sample_slots=sample_slots,
            sample_positions=sample_positions,
        )
        if step.draft_counts is not None:
            add_verify_rows(hb, step, self.cfg.max_num_seqs)
        return hb

    def device_meta(self, hb: HostBatch) -> AttentionMetadata:
        n_pre = hb.num_prefills
        decode_slots, decode_lens = hb.decode_rows()
        meta = AttentionMetadata(
            slot_mapping=self.to_dev(hb.slot_mapping),
            num_prefill_tokens=int(hb.cu[n_pre]),
            num_prefills=n_pre,
            num_decodes=len(decode_slots),
        )
        if n_pre:
            tables = self.block_tables[hb.slots[:n_pre], : hb.width]
            self.set_prefill_meta(meta, hb.q_lens[:n_pre], hb.seq_lens[:n_pre], tables)
        if meta.num_decodes:
            self.set_decode_meta(meta, decode_slots, decode_lens, hb.width)
        return meta

    def _input_ids(self, step: StepCommand, hb: HostBatch, sample_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids on the device; -1 stands for the token this worker sampled last for that slot (async
        scheduling sends the step before the coordinator knows that token). ``sample_slots``: the step's sampled
        slots already on the device; in a decode-only step of placeholders only (async decoding's steady state)
        they are the rows' slots, and the ids are one gather from them, no copy."""
        placeholders = step.token_ids == -1
        if sample_slots is not None and len(hb.sample_slots) == len(step.token_ids) and placeholders.all():
            return self.last_tokens[sample_slots]
        ids = self.to_dev(step.token_ids)
        if placeholders.any():
            token_slots = self.to_dev(np.repeat(hb.slots, hb.q_lens))
            ids = torch.where(ids == -1, self.last_tokens[token_slots], ids)
        if self.drafter is not None and step.draft_counts is not None:  # EAGLE-3: this worker's drafts go in
            ids = self.drafter.fill(step, hb, ids)
        return ids

    def _forward(self, step: StepCommand, hb: HostBatch, sample_slots: torch.Tensor | None = None) -> torch.Tensor:
        input_ids = self.step_ids = self._input_ids(step, hb, sample_slots)
        # verify rows replay a decode graph when laid out as one decode row per token (worker/speculative.py)
        if self.graphs is not None and hb.num_prefills == 0 and len(input_ids) <= self.graphs.max_batch:
            decode_slots, decode_lens = hb.decode_rows()
            tables = self.block_tables[decode_slots, : hb.width]
            return self.graphs.run(self.stager, input_ids, hb.positions, hb.slot_mapping, decode_lens, tables)
        if self.prefill_graphs is not None:
            rows = hb.attention_rows(self.block_tables)
            if self.prefill_graphs.holds(len(input_ids), len(rows[0])):
                return self.prefill_graphs.run(self.stager, input_ids, hb.positions, hb.slot_mapping, *rows)
        return self.run_model(input_ids, hb.positions, self.device_meta(hb))

    def run_model(self, input_ids: torch.Tensor, positions: np.ndarray, meta: AttentionMetadata) -> torch.Tensor:
        """An eager forward with prefill tokens (a step the prefill graphs do not hold)."""
        with forward_context(meta, self.backend):
            return self.model(input_ids, self.to_dev(positions))

    @torch.inference_mode()
    def launch(self, step: StepCommand) -> PendingTokens | AwaitingMasks:
        """Enqueue one step on the device without waiting for it; the sampled ids arrive in a host buffer. On rank
        0, a step whose token bitmasks follow stops after its logits, until ``AwaitingMasks.finish``."""
        self.stager.begin_step()
        self.apply_slot_updates(step)
        hb = self.prepare_host(step) if len(step.slots) else None
        if hb is None:
            return no_tokens(step.step_id)
        prompt_rows = self.prompt_logprobs.rows(hb.slots, hb.cu, hb.positions)  # None unless a sequence asks
        if len(hb.sample_idx) == 0:  # partial prefill chunks only
            hidden = self._forward(step, hb)
            if self.drafter is not None:
                self.drafter.catch_up(hb, self.step_ids, hb.sample_idx, None, None)
            prompt = self.prompt_logprobs_of(hidden, prompt_rows)
            if prompt is None:
                return no_tokens(step.step_id)
            return self.results.pending(step.step_id, hidden.new_empty(0, dtype=torch.int64), prompt=prompt)
        slots_dev = self.to_dev(hb.sample_slots)
        hidden = self._forward(step, hb, slots_dev)
        # sample_idx picks increasing token rows: as many as there are tokens means every row, in order (a
        # decode-only step), and the gather (a copy to the device and an index kernel) is skipped
        rows = hidden if len(hb.sample_idx) == hidden.shape[0] else hidden[self.to_dev(hb.sample_idx)]
        if hb.verify is not None:
            return self.launch_verify(step, hb, hidden, rows, slots_dev, prompt_rows)
        sampled = self.sample_rows(rows, hb, slots_dev, step)
        if callable(sampled):  # the bitmasks are still to come
            return AwaitingMasks(
                step.step_id, lambda masks: self._results(hb, slots_dev, hidden, prompt_rows, step, sampled(masks))
            )
        return self._results(hb, slots_dev, hidden, prompt_rows, step, sampled)

    def _results(self, hb: HostBatch, slots_dev, hidden, prompt_rows, step: StepCommand, sampled) -> PendingTokens:
        if self.drafter is not None:  # the sampled tokens are known on every rank: the draft catches up
            last = self.to_dev(hb.sample_idx)
            self.drafter.catch_up(hb, self.step_ids, hb.sample_idx, sampled[0], last)
        return self.step_results(hb, slots_dev, hidden, prompt_rows, step, sampled)

    def execute(self, step: StepCommand) -> np.ndarray:
        """Run one step and wait; returns sampled token ids on rank 0 (empty elsewhere)."""
        return self.launch(step).wait()

    @torch.inference_mode()
    def forward_logits(self, step: StepCommand) -> torch.Tensor:
        """Teacher-forced logits of every computed token (tests and parity checks)."""
        self.apply_slot_updates(step)
        hb = self.prepare_host(step)
        return self.model.compute_logits(self._forward(step, hb))
