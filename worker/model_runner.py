"""Turns a step (which sequences, which tokens, where their KV lives) into flat tensors, runs the model and
samples. Per-sequence state lives in slot-indexed numpy arrays so every step is a handful of vectorized ops."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import AttentionMetadata, get_backend
from model.config import ModelConfig, parse_dtype
from model.context import forward_context
from model.layers import PagedAttention
from model.loader import load_model
from model.parallel import broadcast_from_rank0, tp_rank
from protocol.messages import StepCommand, WorkerConfig
from worker.cuda_graphs import DecodeGraphs
from worker.sampler import SamplingTensors, sample


@dataclass(slots=True)
class PendingTokens:
    """A launched step's sampled ids: valid in ``host`` once ``event`` (None = already done) has completed."""

    step_id: int
    event: torch.cuda.Event | None
    host: np.ndarray

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
        self.model = load_model(cfg.model, device, self.dtype, cfg.load_format, cfg.seed)
        self.backend = get_backend(cfg.attention_backend, device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed)
        self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None
        self.last_tokens = torch.zeros(cfg.max_num_seqs, dtype=torch.int64, device=device)
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

    # ---- KV pool ---------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        layer = self.attn_layers[0]
        per_token = 2 * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return per_token * self.block_size * len(self.attn_layers)

    def allocate_kv(self, num_blocks: int) -> None:
        layer = self.attn_layers[0]
        shape = (len(self.attn_layers), 2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
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
        tokens = min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len * self.cfg.max_num_seqs)
        seq_len = min(self.cfg.max_model_len, tokens)
        num_seqs = max(1, tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
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

    def _warmup_prefill(self, num_seqs: int, seq_len: int, blocks_per_seq: int) -> None:
        tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
        tokens = np.zeros(num_seqs * seq_len, dtype=np.int32)
        positions = np.tile(np.arange(seq_len), num_seqs)
        rows = np.repeat(np.arange(num_seqs), seq_len)
        slots = tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size
        meta = AttentionMetadata(self._to_dev(slots), len(tokens), num_seqs, 0)
        self._set_prefill_meta(meta, np.full(num_seqs, seq_len), np.full(num_seqs, seq_len), tables)
        with torch.inference_mode(), forward_context(meta, self.backend):
            hidden = self.model(self._to_dev(tokens), self._to_dev(positions))
            self.model.compute_logits(hidden[-num_seqs:])

    # ---- one step --------------------------------------------------------------------------------------

    def _to_dev(self, arr: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # decoded from a message buffer; torch wants writable memory
            arr = arr.copy()
        return torch.from_numpy(arr).to(device=self.device, dtype=dtype, non_blocking=True)

    def _set_prefill_meta(self, meta: AttentionMetadata, q_lens, seq_lens, tables) -> None:
        cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        meta.cu_seqlens_q = self._to_dev(cu, torch.int32)
        meta.prefill_seq_lens = self._to_dev(seq_lens, torch.int32)
        meta.prefill_block_tables = self._to_dev(tables, torch.int32)
        meta.max_seqlen_q, meta.max_seqlen_k = int(q_lens.max()), int(seq_lens.max())

    def apply_slot_updates(self, step: StepCommand) -> None:
        """Start new sequences in their slots and append newly allocated blocks."""
        if len(step.freed_slots):
            self.num_seq_blocks[step.freed_slots] = 0
        new = step.new_slots
        if len(new):
            self.num_seq_blocks[new] = 0
            self.num_computed[new] = step.new_start_pos
            self.temperature[new] = step.new_temperature
            self.top_p[new] = step.new_top_p
            self.top_k[new] = step.new_top_k
            self.min_p[new] = step.new_min_p
            self.seed[new] = step.new_seed
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
        slots, q_lens = step.slots.astype(np.int64), step.num_tokens.astype(np.int64)
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
        return HostBatch(
            slots=slots,
            q_lens=q_lens,
            seq_lens=seq_lens,
            cu=cu,
            positions=positions,
            slot_mapping=slot_mapping,
            num_prefills=int(np.count_nonzero(q_lens > 1)),
            width=-(-int(seq_lens.max()) // self.block_size),
            sample_idx=cu[1:][step.sample_rows] - 1,
            sample_slots=slots[step.sample_rows],
            sample_positions=seq_lens[step.sample_rows],
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

    def _input_ids(self, step: StepCommand, hb: HostBatch) -> torch.Tensor:
        """Token ids on the device; -1 stands for the token this worker sampled last for that slot (async
        scheduling sends the step before the coordinator knows that token)."""
        ids = self._to_dev(step.token_ids)
        if (step.token_ids < 0).any():
            token_slots = self._to_dev(np.repeat(hb.slots, hb.q_lens))
            ids = torch.where(ids < 0, self.last_tokens[token_slots], ids)
        return ids

    def _forward(self, step: StepCommand, hb: HostBatch) -> torch.Tensor:
        input_ids = self._input_ids(step, hb)
        if self.graphs is not None and hb.num_prefills == 0 and len(hb.slots) <= self.graphs.max_batch:
            tables = self.block_tables[hb.slots, : hb.width]
            return self.graphs.run(input_ids, hb.positions, hb.slot_mapping, hb.seq_lens, tables)
        with forward_context(self.device_meta(hb), self.backend):
            return self.model(input_ids, self._to_dev(hb.positions))

    def sampling_tensors(self, sample_slots: np.ndarray, sample_positions: np.ndarray) -> SamplingTensors:
        t, k, p = self.temperature[sample_slots], self.top_k[sample_slots], self.top_p[sample_slots]
        mp, sd = self.min_p[sample_slots], self.seed[sample_slots]
        return SamplingTensors(
            temperature=self._to_dev(t, torch.float32),
            top_k=self._to_dev(k),
            top_p=self._to_dev(p, torch.float32),
            min_p=self._to_dev(mp, torch.float32),
            seed=self._to_dev(sd),
            position=self._to_dev(sample_positions),
            all_greedy=bool((t == 0).all()),
            any_top_k=bool((k > 0).any()),
            any_top_p=bool((p < 1).any()),
            any_min_p=bool((mp > 0).any()),
            any_seed=bool((sd >= 0).any()),
        )

    @torch.inference_mode()
    def launch(self, step: StepCommand) -> PendingTokens:
        """Enqueue one step on the device without waiting for it; the sampled ids arrive in a host buffer."""
        self.apply_slot_updates(step)
        hb = self.prepare_host(step) if len(step.slots) else None
        if hb is None or len(hb.sample_idx) == 0:
            if hb is not None:
                self._forward(step, hb)
            return PendingTokens(step.step_id, None, np.zeros(0, dtype=np.int32))
        hidden = self._forward(step, hb)
        logits = self.model.compute_logits(hidden[self._to_dev(hb.sample_idx)])
        if tp_rank() == 0:
            tokens = sample(logits, self.sampling_tensors(hb.sample_slots, hb.sample_positions), self.generator)
        else:
            tokens = torch.empty(len(hb.sample_idx), dtype=torch.int64, device=self.device)
        tokens = broadcast_from_rank0(tokens)  # every rank feeds the same tokens into the next step
        self.last_tokens[self._to_dev(hb.sample_slots)] = tokens
        if tp_rank() != 0:
            return PendingTokens(step.step_id, None, np.zeros(0, dtype=np.int32))
        if self.device.type != "cuda":
            return PendingTokens(step.step_id, None, tokens.to(torch.int32).numpy())
        # pinned buffers in a ring (allocating pinned memory per step is slow); at most two steps are in flight
        self._ring = (self._ring + 1) % len(self._pinned)
        host = self._pinned[self._ring][: len(tokens)]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingTokens(step.step_id, event, host.numpy())

    def execute(self, step: StepCommand) -> np.ndarray:
        """Run one step and wait; returns sampled token ids on rank 0 (empty elsewhere)."""
        return self.launch(step).wait()

    @torch.inference_mode()
    def forward_logits(self, step: StepCommand) -> torch.Tensor:
        """Teacher-forced logits of every computed token (tests and parity checks)."""
        self.apply_slot_updates(step)
        hb = self.prepare_host(step)
        return self.model.compute_logits(self._forward(step, hb))

    def capture_graphs(self) -> None:
        """CUDA graphs for decode-only steps (after the KV pool exists); no-op on CPU or with enforce_eager."""
        if self.device.type != "cuda" or self.cfg.enforce_eager:
            return
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
