"""CUDA graphs for decode-only steps (steps with prefill tokens: worker/prefill_graphs.py).

Decode: one graph per batch-size bucket, captured largest first into one shared memory pool. Captured tensors
keep their addresses, so each step copies its inputs into static buffers, pads the batch up to the bucket
(slot -1: nothing written; length 0: nothing read) and keeps the block-table width fixed at its maximum.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import nn

from kernels.attention import AttentionBackend, AttentionMetadata
from model.context import forward_context
from worker.transfer import HostStager


class StaticTokens:
    """The token ids, positions and slot mapping a graph reads, for up to ``rows`` rows (slot -1: no KV write)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros_like(self.input_ids)
        self.slot_mapping = torch.full_like(self.input_ids, -1)

    def load_tokens(
        self, stager: HostStager, input_ids: torch.Tensor, positions: np.ndarray, slot_mapping: np.ndarray, rows: int
    ) -> None:
        """A step's ``len(input_ids)`` tokens, padded to ``rows`` with rows that write no KV."""
        n = len(input_ids)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(stager.to_device(positions))
        self.slot_mapping[:n].copy_(stager.to_device(slot_mapping))
        self.slot_mapping[n:rows].fill_(-1)


def graph_decode_meta(
    bs: int, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int
) -> AttentionMetadata:
    """A graph's decode rows: the first ``bs`` of its static buffers, the split-K count fixed for ``max_seq_len``
    (the longest context a replay may see)."""
    return AttentionMetadata(
        slot_mapping=slot_mapping[:bs],
        num_prefill_tokens=0,
        num_prefills=0,
        num_decodes=bs,
        decode_seq_lens=seq_lens[:bs],
        decode_block_tables=block_tables[:bs],
        max_decode_seq_len=max_seq_len,
    )


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs(StaticTokens):
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        max_batch: int,
        max_blocks: int,
        max_seq_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        super().__init__(max_batch, device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for bs in reversed(self.buckets):
            meta = graph_decode_meta(bs, self.slot_mapping, self.seq_lens, self.block_tables, max_seq_len)
            with forward_context(meta, backend):
                model(self.input_ids[:bs], self.positions[:bs])  # compile kernels outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = graph
        self.pool = pool  # the EAGLE-3 draft's graphs share it (worker/eagle_graphs.py)
        torch.cuda.synchronize(device)

    def run(
        self,
        stager: HostStager,
        input_ids: torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        n = len(input_ids)
        bs = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.load_tokens(stager, input_ids, positions, slot_mapping, bs)
        self.seq_lens[:n].copy_(stager.to_device(seq_lens, torch.int32))
        self.seq_lens[n:bs].fill_(0)
        self.block_tables[:n, : block_tables.shape[1]].copy_(stager.to_device(block_tables, torch.int32))
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
