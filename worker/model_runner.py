"""Turns a step (which sequences, which tokens, where their KV lives) into flat tensors, runs the model and
samples. Per-sequence state lives in slot-indexed numpy arrays so every step is a handful of vectorized ops."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels import cublaslt
from kernels.attention import AttentionMetadata, get_backend
from kernels.decode_gemm import decode_linear_tiles
from kernels.sampling import warmup as sampling_warmup
from kernels.triton_attention import TritonAttentionBackend
from model.config import ModelConfig, parse_dtype
from model.context import forward_context
from model.fp8 import parse_kv_cache_dtype
from model.layers import PagedAttention
from model.linear import LinearBase
from model.loader import load_model
from model.parallel import all_gather_stack, broadcast_from_rank0, tp_rank, tp_size
from protocol.messages import StepCommand, WorkerConfig
from protocol.settings import settings
from worker.cuda_graphs import DecodeGraphs, PrefillGraphs, batch_buckets
from worker.sampler import (
    SamplingTensors,
    pick_across_shards,
    sample,
    samples_on_shards,
    shard_candidates,
    uses_fused_kernel,
)
from worker.transfer import HostStager


@dataclass(slots=True)
class PendingTokens:
    """A launched step's sampled ids: valid in ``host`` (and the logprob arrays, when some row asked for
    logprobs) once ``event`` (None = already done) has completed."""

    step_id: int
    event: torch.cuda.Event | None
    host: np.ndarray
    logprob_token_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host


@dataclass(slots=True)
class HostBatch:
    """One step's flat inputs on the host, prefill sequences first."""

    slots: np.ndarray
    q_lens: np.ndarray
    seq_lens: np.ndarray  # context length after this step
    cu: np.ndarray  # [n + 1] token offsets
    positions: np.ndarray
    slot_mapping: np.ndarray
    num_prefills: int
    width: int  # block-table columns needed this step
    sample_idx: np.ndarray  # token rows whose logits are sampled
    sample_slots: np.ndarray
    sample_positions: np.ndarray


class ModelRunner:
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
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.last_tokens = torch.zeros(cfg.max_num_seqs, dtype=torch.int64, device=device)
        self.stager = HostStager(device)
        pin = device.type == "cuda"
        self._pinned = [torch.empty(cfg.max_num_seqs, dtype=torch.int32, pin_memory=pin) for _ in range(4)]
        self._ring = 0

        # slot-indexed sequence state
        n, width = cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_size)
        self.block_tables = np.zeros((n, width), dtype=np.int32)
        self.num_seq_blocks = np.zeros(n, dtype=np.int64)
        self.num_computed = np.zeros(n, dtype=np.int64)
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_p = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.seed = np.full(n, -1, dtype=np.int64)
        # optional controls (defaults = off); any_controls says whether some slot uses one, so a step where
        # none does pays a single flag check
        self.min_tokens_left = np.zeros(n, dtype=np.int64)  # samples still to take with stop_ids masked
        self.stop_ids = np.full((n, 0), -1, dtype=np.int64)  # [n, widest list] ids masked before min_tokens
        self.presence_penalty = np.zeros(n, dtype=np.float32)
        self.frequency_penalty = np.zeros(n, dtype=np.float32)
        self.repetition_penalty = np.ones(n, dtype=np.float32)
        self.has_penalty = np.zeros(n, dtype=bool)
        self.num_logprobs = np.full(n, -1, dtype=np.int64)  # top-N logprobs per sampled token; -1 = none
        self.any_controls = False
        # rank 0, allocated when a penalized sequence first arrives: output token counts and prompt-token mask
        self.output_counts: torch.Tensor | None = None  # [max_num_seqs, vocab] int32
        self.prompt_mask: torch.Tensor | None = None  # [max_num_seqs, vocab] bool
        self._pinned_lp: list[tuple[torch.Tensor, torch.Tensor]] = []  # ring of host buffers for logprobs (CUDA)

    # ---- KV pool ---------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        layer = self.attn_layers[0]
        per_token = 2 * layer.num_kv_heads * layer.head_dim * self.kv_dtype.itemsize
        return per_token * self.block_size * len(self.attn_layers)

    def allocate_kv(self, num_blocks: int) -> None:
        layer = self.attn_layers[0]
        shape = (len(self.attn_layers), 2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.num_blocks = num_blocks

    def available_kv_blocks(self) -> int:
        """How many blocks fit on this rank: explicit count, CPU budget, or measured CUDA headroom."""
        cfg = self.cfg
        useful = cfg.max_num_seqs * self.block_tables.shape[1] + 1
        if cfg.num_kv_blocks > 0:
            return cfg.num_kv_blocks
        if self.device.type != "cuda":
            return max(1, min(useful, cfg.kv_cache_memory_bytes // self.kv_block_bytes))
        return self._profile_cuda_blocks()

    def _profile_cuda_blocks(self) -> int:
        # Peak activation memory of a forward at the largest batch, then the seed's formula.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_seqs, seq_len, blocks_per_seq = self._largest_prefill()
        self.allocate_kv(num_seqs * blocks_per_seq)
        self._warmup_prefill(num_seqs, seq_len, blocks_per_seq)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        kv_now = self.kv_cache.numel() * self.kv_cache.element_size()
        budget = total * self.cfg.gpu_memory_utilization - (total - free) - (peak - current) + kv_now
        del self.kv_cache
        torch.cuda.empty_cache()
        return max(0, int(budget) // self.kv_block_bytes)

    def _largest_prefill(self) -> tuple[int, int, int]:
        """(sequences, tokens each, blocks each) of the largest prefill step the limits allow."""
        tokens = min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len * self.cfg.max_num_seqs)
        seq_len = min(self.cfg.max_model_len, tokens)
        return max(1, tokens // seq_len), seq_len, -(-seq_len // self.block_size)

    def _warmup_prefill(self, num_seqs: int, seq_len: int, blocks_per_seq: int) -> None:
        tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
        tokens = np.zeros(num_seqs * seq_len, dtype=np.int32)
        positions = np.tile(np.arange(seq_len), num_seqs)
        rows = np.repeat(np.arange(num_seqs), seq_len)
        slots = tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size
        meta = AttentionMetadata(self._to_dev(slots), len(tokens), num_seqs, 0)
        self._set_prefill_meta(meta, np.full(num_seqs, seq_len), np.full(num_seqs, seq_len), tables)
        with torch.inference_mode():
            hidden = self._run_model(self._to_dev(tokens), positions, meta)
            self.model.compute_logits(hidden[-num_seqs:])

    # ---- one step --------------------------------------------------------------------------------------

    def _to_dev(self, arr: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return self.stager.to_device(arr, dtype)

    def _set_prefill_meta(self, meta: AttentionMetadata, q_lens, seq_lens, tables) -> None:
        cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        meta.cu_seqlens_q = self._to_dev(cu, torch.int32)
        meta.prefill_seq_lens = self._to_dev(seq_lens, torch.int32)
        meta.prefill_block_tables = self._to_dev(tables, torch.int32)
        meta.max_seqlen_q, meta.max_seqlen_k = int(q_lens.max()), int(seq_lens.max())

    def apply_slot_updates(self, step: StepCommand) -> None:
        """Start new sequences in their slots and append newly allocated blocks."""
        freed, new = step.freed_slots, step.new_slots
        if len(freed):
            self.num_seq_blocks[freed] = 0
            if self.any_controls:
                self._reset_controls(freed)
        if len(new):
            self.num_seq_blocks[new] = 0
            self.num_computed[new] = step.new_start_pos
            self.temperature[new] = step.new_temperature
            self.top_p[new] = step.new_top_p
            self.top_k[new] = step.new_top_k
            self.min_p[new] = step.new_min_p
            self.seed[new] = step.new_seed
            self._start_controls(step)
        counts = step.new_block_counts
        total = int(counts.sum()) if len(counts) else 0
        if total:
            rows = np.repeat(step.slots, counts)
            group_start = np.repeat(np.cumsum(counts) - counts, counts)
            cols = np.repeat(self.num_seq_blocks[step.slots], counts) + (np.arange(total) - group_start)
            self.block_tables[rows, cols] = step.new_block_ids
            self.num_seq_blocks[step.slots] += counts

    # ---- min_tokens, penalties, logprobs ---------------------------------------------------------------

    def _reset_controls(self, slots: np.ndarray) -> None:
        self.min_tokens_left[slots] = 0
        self.has_penalty[slots] = False
        self.num_logprobs[slots] = -1
        self._refresh_any_controls()

    def _refresh_any_controls(self) -> None:
        self.any_controls = bool(self.min_tokens_left.any() or self.has_penalty.any() or (self.num_logprobs >= 0).any())

    def _start_controls(self, step: StepCommand) -> None:
        """Per-slot min_tokens masks, penalties and logprobs of the sequences starting this step (vectorized)."""
        new = step.new_slots.astype(np.int64)
        left, counts = step.new_min_tokens, step.new_stop_id_counts
        pres, freq, rep = step.new_presence_penalty, step.new_frequency_penalty, step.new_repetition_penalty
        penalized = (pres != 0) | (freq != 0) | (rep != 1)
        uses = bool(left.any() or penalized.any() or (step.new_logprobs >= 0).any())
        if not uses:
            if self.any_controls:  # a slot's previous sequence may have used them
                self._reset_controls(new)
            return
        self.min_tokens_left[new] = left
        self.stop_ids[new] = -1
        total = int(counts.sum())
        if total:
            width = int(counts.max())
            if width > self.stop_ids.shape[1]:
                grown = np.full((len(self.stop_ids), width), -1, dtype=np.int64)
                grown[:, : self.stop_ids.shape[1]] = self.stop_ids
                self.stop_ids = grown
            rows = np.repeat(new, counts)
            cols = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            self.stop_ids[rows, cols] = step.new_stop_ids
        self.presence_penalty[new], self.frequency_penalty[new], self.repetition_penalty[new] = pres, freq, rep
        self.has_penalty[new] = penalized
        self.num_logprobs[new] = step.new_logprobs
        if penalized.any() and tp_rank() == 0:
            self._start_penalty_state(step, new, penalized)
        self._refresh_any_controls()

    def _start_penalty_state(self, step: StepCommand, new: np.ndarray, penalized: np.ndarray) -> None:
        """Reset the penalized slots' device state and fill it from the tokens they already have: the prompt
        (repetition penalty; prefix-cache hits are never computed here, so the coordinator sends it) and, after
        a preemption, the outputs so far."""
        if self.output_counts is None:
            shape = (self.cfg.max_num_seqs, self.model_config.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        slots = self._to_dev(new[penalized])
        self.output_counts[slots] = 0
        self.prompt_mask[slots] = False
        p_lens, o_lens = step.new_penalty_prompt_lens, step.new_penalty_output_lens
        lens = p_lens.astype(np.int64) + o_lens
        total = int(lens.sum())
        if not total:
            return
        owner = np.repeat(np.arange(len(new)), lens)
        offset = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        in_prompt = offset < p_lens[owner]
        ids, tok_slots = step.new_penalty_token_ids, new[owner]
        if in_prompt.any():
            self.prompt_mask[self._to_dev(tok_slots[in_prompt]), self._to_dev(ids[in_prompt])] = True
        out = ~in_prompt
        if out.any():
            ones = torch.ones(int(out.sum()), dtype=torch.int32, device=self.device)
            index = (self._to_dev(tok_slots[out]), self._to_dev(ids[out]))
            self.output_counts.index_put_(index, ones, accumulate=True)

    def _add_controls(self, st: SamplingTensors, sample_slots: np.ndarray) -> None:
        """min_tokens bans and penalties of this step's sampled rows (rank 0; only when some slot uses them)."""
        rows = np.flatnonzero(self.min_tokens_left[sample_slots] > 0)
        if len(rows):
            ids = self.stop_ids[sample_slots[rows]]
            r, c = np.nonzero(ids >= 0)
            st.banned = (self._to_dev(rows[r]), self._to_dev(ids[r, c]))
        rows = np.flatnonzero(self.has_penalty[sample_slots])
        if len(rows):
            slots = sample_slots[rows]
            slots_dev = self._to_dev(slots)
            st.penalty_rows = self._to_dev(rows)
            st.presence_penalty = self._to_dev(self.presence_penalty[slots], torch.float32)
            st.frequency_penalty = self._to_dev(self.frequency_penalty[slots], torch.float32)
            st.repetition_penalty = self._to_dev(self.repetition_penalty[slots], torch.float32)
            st.output_counts = self.output_counts[slots_dev]
            st.prompt_mask = self.prompt_mask[slots_dev]

    def _after_sample(
        self, st: SamplingTensors, sample_slots: np.ndarray, slots_dev: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Count the sampled tokens into the penalized slots' outputs (on the device) and advance min_tokens."""
        if st.penalty_rows is not None:
            rows = st.penalty_rows
            index = (slots_dev[rows], tokens[rows])
            ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, ones, accumulate=True)
        if st.banned is not None:
            slots = sample_slots[self.min_tokens_left[sample_slots] > 0]
            self.min_tokens_left[slots] -= 1
            if not self.min_tokens_left[slots].any():
                self._refresh_any_controls()

    def _logprobs(self, logits: torch.Tensor, sample_slots: np.ndarray) -> tuple[np.ndarray, torch.Tensor] | None:
        """Rows asking for logprobs and the log-softmax of their raw logits (vLLM's default: before penalties,
        temperature and filters); None when no row asks."""
        rows = np.flatnonzero(self.num_logprobs[sample_slots] >= 0)
        if not len(rows):
            return None
        return rows, logits[self._to_dev(rows)].float().log_softmax(-1)

    def _gather_logprobs(
        self, rows: np.ndarray, logprobs: torch.Tensor, sample_slots: np.ndarray, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat (token ids int32, logprobs float32): per row, the sampled token then its top N, N per row."""
        n = self.num_logprobs[sample_slots[rows]]
        k = int(n.max())
        sampled = tokens[self._to_dev(rows)].unsqueeze(1)
        ids, values = sampled, logprobs.gather(1, sampled)
        if k:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            ids, values = torch.cat([ids, top_ids], 1), torch.cat([values, top_values], 1)
        per_row = n + 1
        total = int(per_row.sum())
        cols = np.arange(total) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        flat = self._to_dev(np.repeat(np.arange(len(rows)), per_row) * (k + 1) + cols)
        return ids.reshape(-1)[flat].to(torch.int32), values.reshape(-1)[flat]

    # ---- one step --------------------------------------------------------------------------------------

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
        return HostBatch(
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

    def device_meta(self, hb: HostBatch) -> AttentionMetadata:
        n_pre = hb.num_prefills
        meta = AttentionMetadata(
            slot_mapping=self._to_dev(hb.slot_mapping),
            num_prefill_tokens=int(hb.cu[n_pre]),
            num_prefills=n_pre,
            num_decodes=len(hb.slots) - n_pre,
        )
        if n_pre:
            tables = self.block_tables[hb.slots[:n_pre], : hb.width]
            self._set_prefill_meta(meta, hb.q_lens[:n_pre], hb.seq_lens[:n_pre], tables)
        if meta.num_decodes:
            meta.decode_seq_lens = self._to_dev(hb.seq_lens[n_pre:], torch.int32)
            meta.decode_block_tables = self._to_dev(self.block_tables[hb.slots[n_pre:], : hb.width], torch.int32)
            meta.max_decode_seq_len = int(hb.seq_lens[n_pre:].max())
        return meta

    def _input_ids(self, step: StepCommand, hb: HostBatch, sample_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids on the device; -1 stands for the token this worker sampled last for that slot (async
        scheduling sends the step before the coordinator knows that token). ``sample_slots``: the step's sampled
        slots already on the device; in a decode-only step of placeholders only (async decoding's steady state)
        they are the rows' slots, and the ids are one gather from them, no copy."""
        placeholders = step.token_ids < 0
        if sample_slots is not None and len(hb.sample_slots) == len(step.token_ids) and placeholders.all():
            return self.last_tokens[sample_slots]
        ids = self._to_dev(step.token_ids)
        if placeholders.any():
            token_slots = self._to_dev(np.repeat(hb.slots, hb.q_lens))
            ids = torch.where(ids < 0, self.last_tokens[token_slots], ids)
        return ids

    def _forward(self, step: StepCommand, hb: HostBatch, sample_slots: torch.Tensor | None = None) -> torch.Tensor:
        input_ids = self._input_ids(step, hb, sample_slots)
        if self.graphs is not None and hb.num_prefills == 0 and len(hb.slots) <= self.graphs.max_batch:
            tables = self.block_tables[hb.slots, : hb.width]
            return self.graphs.run(self.stager, input_ids, hb.positions, hb.slot_mapping, hb.seq_lens, tables)
        return self._run_model(input_ids, hb.positions, self.device_meta(hb))

    def _run_model(self, input_ids: torch.Tensor, positions: np.ndarray, meta: AttentionMetadata) -> torch.Tensor:
        """A forward with prefill tokens: through the prefill graphs where they hold the step, else eagerly."""
        if self.prefill_graphs is not None and len(input_ids) <= self.prefill_graphs.max_tokens:
            return self.prefill_graphs.run(self.stager, input_ids, positions, meta, self.backend)
        with forward_context(meta, self.backend):
            return self.model(input_ids, self._to_dev(positions))

    def sampling_tensors(self, sample_slots: np.ndarray, sample_positions: np.ndarray) -> SamplingTensors:
        t, k, p = self.temperature[sample_slots], self.top_k[sample_slots], self.top_p[sample_slots]
        mp, sd = self.min_p[sample_slots], self.seed[sample_slots]
        all_greedy = bool((t == 0).all())
        flags = bool((k > 0).any()), bool((p < 1).any()), bool((mp > 0).any()), bool((sd >= 0).any())
        # copy only the controls the chosen path reads: none for an all-greedy argmax, the temperature alone for
        # the fused CUDA kernel (W1's case: one copy per step instead of six)
        fused = uses_fused_kernel(self.device.type == "cuda", *flags)
        copy = (lambda arr, dtype=torch.int64: None) if all_greedy or fused else self._to_dev
        st = SamplingTensors(
            temperature=None if all_greedy else self._to_dev(t, torch.float32),
            top_k=copy(k),
            top_p=copy(p, torch.float32),
            min_p=copy(mp, torch.float32),
            seed=copy(sd),
            position=copy(sample_positions),
            all_greedy=all_greedy,
            any_top_k=flags[0],
            any_top_p=flags[1],
            any_min_p=flags[2],
            any_seed=flags[3],
        )
        if self.any_controls:
            self._add_controls(st, sample_slots)
        return st

    @torch.inference_mode()
    def launch(self, step: StepCommand) -> PendingTokens:
        """Enqueue one step on the device without waiting for it; the sampled ids arrive in a host buffer."""
        self.stager.begin_step()
        self.apply_slot_updates(step)
        hb = self.prepare_host(step) if len(step.slots) else None
        if hb is None or len(hb.sample_idx) == 0:
            if hb is not None:
                self._forward(step, hb)
            return PendingTokens(step.step_id, None, np.zeros(0, dtype=np.int32))
        slots_dev = self._to_dev(hb.sample_slots)
        hidden = self._forward(step, hb, slots_dev)
        # sample_idx picks increasing token rows: as many as there are tokens means every row, in order (a
        # decode-only step), and the gather (a copy to the device and an index kernel) is skipped
        rows = hidden if len(hb.sample_idx) == hidden.shape[0] else hidden[self._to_dev(hb.sample_idx)]
        noise_seed = int(self.noise_seeds.integers(1 << 31))  # drawn on every rank: shard sampling shares it
        lp = None
        # the controls (penalties, min_tokens, logprobs) live on rank 0; without them every rank can build st
        st = (
            self.sampling_tensors(hb.sample_slots, hb.sample_positions)
            if tp_rank() == 0 or not self.any_controls
            else None
        )
        if tp_size() > 1 and not self.any_controls and samples_on_shards(self.device.type == "cuda", st):
            # same decision on every rank (same commands): each proposes its vocabulary shard's best per row
            local, start = self.model.compute_shard_logits(rows)
            candidates = shard_candidates(local, st, noise_seed, start, self.model_config.vocab_size)
            tokens = pick_across_shards(all_gather_stack(candidates))
        else:
            logits = self.model.compute_logits(rows)
            if tp_rank() == 0:
                if self.any_controls:
                    lp = self._logprobs(logits, hb.sample_slots)
                tokens = sample(logits, st, self.generator, noise_seed)
                if self.any_controls:
                    self._after_sample(st, hb.sample_slots, slots_dev, tokens)
            else:
                tokens = torch.empty(len(hb.sample_idx), dtype=torch.int64, device=self.device)
            tokens = broadcast_from_rank0(tokens)  # every rank feeds the same tokens into the next step
        self.last_tokens[slots_dev] = tokens
        if tp_rank() != 0:
            return PendingTokens(step.step_id, None, np.zeros(0, dtype=np.int32))
        lp_ids = lp_values = None
        if lp is not None:
            lp_ids, lp_values = self._gather_logprobs(*lp, hb.sample_slots, tokens)
        if self.device.type != "cuda":
            if lp is not None:
                lp_ids, lp_values = lp_ids.numpy(), lp_values.numpy()
            return PendingTokens(step.step_id, None, tokens.to(torch.int32).numpy(), lp_ids, lp_values)
        # pinned buffers in a ring (allocating pinned memory per step is slow): a step's tokens are read before
        # the fourth step after it launches, since at most three are in flight (coordinator async_depth <= 2)
        self._ring = (self._ring + 1) % len(self._pinned)
        host = self._pinned[self._ring][: len(tokens)]
        host.copy_(tokens, non_blocking=True)
        if lp is not None:
            lp_ids, lp_values = self._to_host_pinned(lp_ids, lp_values)
        event = torch.cuda.Event()
        event.record()
        return PendingTokens(step.step_id, event, host.numpy(), lp_ids, lp_values)

    def _to_host_pinned(self, ids: torch.Tensor, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Asynchronous copies of a step's logprobs into the pinned ring slot of its tokens (allocated on first
        use: 21 entries per sequence, the most logprobs=20 needs)."""
        if not self._pinned_lp:
            size = self.cfg.max_num_seqs * 21
            self._pinned_lp = [
                (torch.empty(size, dtype=torch.int32, pin_memory=True), torch.empty(size, pin_memory=True))
                for _ in self._pinned
            ]
        host_ids, host_values = self._pinned_lp[self._ring]
        host_ids, host_values = host_ids[: len(ids)], host_values[: len(values)]
        host_ids.copy_(ids, non_blocking=True)
        host_values.copy_(values, non_blocking=True)
        return host_ids.numpy(), host_values.numpy()

    def execute(self, step: StepCommand) -> np.ndarray:
        """Run one step and wait; returns sampled token ids on rank 0 (empty elsewhere)."""
        return self.launch(step).wait()

    @torch.inference_mode()
    def forward_logits(self, step: StepCommand) -> torch.Tensor:
        """Teacher-forced logits of every computed token (tests and parity checks)."""
        self.apply_slot_updates(step)
        hb = self.prepare_host(step)
        return self.model.compute_logits(self._forward(step, hb))

    def warmup_kernels(self) -> None:
        """Compile the data-dependent Triton kernel variants (attention, sampling) before the first real step."""
        if self.device.type != "cuda":
            return
        if hasattr(self.backend, "warmup"):
            attn = self.attn_layers[0]
            self.backend.warmup(attn.k_cache, attn.v_cache, attn.num_heads, self.dtype)
        sampling_warmup(self.model_config.vocab_size, self.dtype, self.device)  # every rank samples its shard
        # The LM head runs eagerly, at the step's number of sampled rows (the decode graphs end at the hidden
        # states). Without this pass, each prefill step that sampled a row count not seen before blocked the host
        # for about the step's whole device time (cuBLAS loading that size's kernel on first use, we suspect).
        rows = torch.zeros(self.cfg.max_num_seqs, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            for n in range(1, self.cfg.max_num_seqs + 1):
                self.model.compute_logits(rows[:n])
                if tp_size() > 1:  # the shard sampler's product (the last shard may be narrower)
                    self.model.compute_shard_logits(rows[:n])
        torch.cuda.synchronize(self.device)

    def warm_prefill_pool(self) -> None:
        """The KV sizing's prefill once more, after graph capture and before the first real one: it compiles the
        prefill attention kernel, and either replays the prefill graphs once or leaves the eager activations'
        blocks in the caching allocator (the KV sizing released them)."""
        if self.device.type != "cuda":
            return
        num_seqs, seq_len, blocks_per_seq = self._largest_prefill()  # the shape the KV sizing profiled
        num_seqs = min(num_seqs, self.num_blocks // blocks_per_seq)
        if num_seqs == 0:
            return
        self._warmup_prefill(num_seqs, seq_len, blocks_per_seq)  # writes KV only into blocks no sequence owns yet
        torch.cuda.synchronize(self.device)

    def _tune_decode_gemms(self) -> None:
        """Choose cuBLASLt algorithms for the layer products at each decode graph's row count, where one beats
        torch's pick (kernels/cublaslt.py). NANOSERVE_LT_TUNE=0 keeps torch's matmul (a faster start)."""
        if not settings().lt_tune or self.dtype not in (torch.bfloat16, torch.float16):
            return
        weights: dict[tuple[int, int], list[torch.Tensor]] = {}
        for module in self.model.modules():
            if isinstance(module, LinearBase) and module.bias is None and module.quant is None:
                weights.setdefault(tuple(module.weight.shape), []).append(module.weight)
        start = time.perf_counter()
        with torch.inference_mode():
            records = cublaslt.tune(
                weights, batch_buckets(self.cfg.max_num_seqs), skip=lambda x, w: decode_linear_tiles(x, w) is not None
            )
        torch.cuda.synchronize(self.device)
        if tp_rank() == 0:  # what the tuning predicts for a step's layer products, per row count
            took = time.perf_counter() - start
            print(f"nanoserve[gemm tuning] ({took:.1f} s): {cublaslt.summary(records)}", file=sys.stderr, flush=True)

    def capture_graphs(self) -> None:
        """CUDA graphs for decode-only steps and, at TP 1 with the Triton backend, piecewise ones for steps with
        prefill tokens (after the KV pool exists); no-op on CPU or with enforce_eager."""
        if self.device.type != "cuda" or self.cfg.enforce_eager:
            return
        self._tune_decode_gemms()
        self.graphs = DecodeGraphs(
            self.model,
            self.backend,
            max_batch=self.cfg.max_num_seqs,
            max_blocks=self.block_tables.shape[1],
            max_seq_len=self.cfg.max_model_len,
            hidden_size=self.model_config.hidden_size,
            dtype=self.dtype,
            device=self.device,
        )
        # Prefill pieces replay attention with the Triton backend's ``out`` argument. Under tensor parallelism
        # their prefill-sized all-reduces would be NCCL collectives inside graphs, not yet checked on the
        # device; TP prefill steps are device-bound anyway (docs/PERF.md log 7).
        if isinstance(self.backend, TritonAttentionBackend) and tp_size() == 1:
            attn = self.attn_layers[0]
            self.prefill_graphs = PrefillGraphs(
                self.model, self.cfg.max_num_batched_tokens, attn.num_heads, attn.head_dim, self.dtype, self.device
            )
