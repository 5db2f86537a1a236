"""CUDA graphs: whole forwards for decode-only steps, piecewise forwards for steps with prefill tokens.

Decode: one graph per batch-size bucket, captured largest first into one shared memory pool. Captured tensors
keep their addresses, so each step copies its inputs into static buffers, pads the batch up to the bucket
(slot -1: nothing written; length 0: nothing read) and keeps the block-table width fixed at its maximum.

Prefill: attention depends on each step's sequence layout (grid sizes, prefill and decode rows), so those
forwards are captured in pieces between consecutive attention calls, one list of pieces per token-count bucket
(see PrefillGraphs)."""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import nn

from kernels.attention import AttentionBackend, AttentionMetadata
from model.context import forward_context
from worker.transfer import HostStager


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts the prefill graphs are captured for: powers of two from 16 to 512, then every 1024 up to
    ``max_tokens``. The small ones matter for a short prompt's first token: padded to 256 tokens, a 128-token
    prefill of an 8B model costs twice the tensor-core work it needs."""
    sizes = [t for t in (16, 32, 64, 128, 256, 512) if t < max_tokens]
    sizes += list(range(1024, max_tokens, 1024)) + [max_tokens]
    return sorted(set(sizes))


def _static_inputs(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token ids, positions and slot mapping a graph reads, for up to ``rows`` rows (slot -1: no KV write)."""
    ids = torch.zeros(rows, dtype=torch.int64, device=device)
    return ids, torch.zeros_like(ids), torch.full_like(ids, -1)


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


class DecodeGraphs:
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
        self.input_ids, self.positions, self.slot_mapping = _static_inputs(max_batch, device)
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
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(stager.to_device(positions))
        self.slot_mapping[:n].copy_(stager.to_device(slot_mapping))
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(stager.to_device(seq_lens, torch.int32))
        self.seq_lens[n:bs].fill_(0)
        self.block_tables[:n, : block_tables.shape[1]].copy_(stager.to_device(block_tables, torch.int32))
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


def _attend_into(out: torch.Tensor, q: torch.Tensor, k_cache, v_cache, scale: float, meta, backend) -> None:
    """One layer's attention of a step (prefill rows first, then decode rows) written into ``out``."""
    n_pre = meta.num_prefill_tokens
    if meta.num_prefills:
        backend.prefill(q[:n_pre], k_cache, v_cache, meta, scale, out[:n_pre])
    if meta.num_decodes:
        backend.decode(q[n_pre:], k_cache, v_cache, meta, scale, out[n_pre:])


class _PieceRecorder:
    """Stands in for the attention backend while a prefill forward is captured: the queries reach the static
    query buffer (the q/k norm + RoPE kernel writes them there; other queries are copied), and at each attention
    call it closes the current piece, opens the next one and hands back the static output buffer. Without
    ``capturing`` it only fills the buffer (an eager pass that compiles every kernel before the capture)."""

    def __init__(self, owner: PrefillGraphs, pool, capturing: bool) -> None:
        self.owner, self.pool, self.capturing = owner, pool, capturing
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.holes: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (k_cache, v_cache, scale) per layer

    def begin(self) -> None:
        self.pieces.append(torch.cuda.CUDAGraph())
        self.pieces[-1].capture_begin(pool=self.pool)

    def end(self) -> None:
        self.pieces[-1].capture_end()

    def query_buffer(self, tokens: int) -> torch.Tensor:
        return self.owner.q_buf[:tokens]  # the q/k norm + RoPE writes the queries where the attention reads them

    def prefill(self, q, k_cache, v_cache, meta, scale, out=None) -> torch.Tensor:
        n = q.shape[0]
        if q.data_ptr() != self.owner.q_buf.data_ptr():
            self.owner.q_buf[:n].copy_(q)
        if self.capturing:
            self.end()
            self.holes.append((k_cache, v_cache, scale))
            self.begin()
        return self.owner.out_buf[:n]


class PrefillGraphs:
    """Piecewise CUDA graphs for steps with prefill tokens, one list of pieces per token-count bucket.

    Eagerly, such a step launches ~400 kernels, and on the H200 hosts launching them took longer than the device
    needed to run them. Here a forward is captured as L + 1 pieces around its L attention calls: piece i ends
    with layer i's queries in a static buffer (its q/k norm + RoPE writes them there); at replay, the layer's
    attention runs eagerly from there (with the step's own metadata) into a static output buffer, which piece
    i + 1 starts from. The q/k norm, RoPE and KV store stay inside the pieces (they read the static positions and
    slot mapping). A step's tokens are padded up to its bucket: padding rows write no KV (slot -1) and attention
    reads only the real rows, so they never reach a real row."""

    def __init__(
        self,
        model: nn.Module,
        max_tokens: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = max_tokens
        self.input_ids, self.positions, self.slot_mapping = _static_inputs(max_tokens, device)
        # zeros, so padding rows start finite; afterwards they hold earlier steps' values
        self.q_buf = torch.zeros(max_tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.out_buf = torch.zeros(max_tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.holes: dict[int, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        for tokens in reversed(self.buckets):  # largest first: the smaller ones reuse its pool memory
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:tokens], num_prefill_tokens=tokens, num_prefills=1, num_decodes=0
            )
            ids, pos = self.input_ids[:tokens], self.positions[:tokens]
            with forward_context(meta, _PieceRecorder(self, pool, capturing=False)):
                model(ids, pos)  # compiles every kernel for this token count outside the capture
            torch.cuda.synchronize(device)
            recorder = _PieceRecorder(self, pool, capturing=True)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                recorder.begin()
                with forward_context(meta, recorder):
                    self.outputs[tokens] = model(ids, pos)
                recorder.end()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.pieces[tokens], self.holes[tokens] = recorder.pieces, recorder.holes
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the eager passes' blocks: steps up to max_tokens run here, not eagerly

    def run(
        self,
        stager: HostStager,
        input_ids: torch.Tensor,
        positions: np.ndarray,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The step's hidden states; ``meta`` is its attention metadata on the device (with its slot mapping)."""
        n = len(input_ids)
        tokens = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(stager.to_device(positions))
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:tokens].fill_(-1)
        q, out = self.q_buf[:n], self.out_buf[:n]
        pieces = self.pieces[tokens]
        for piece, (k_cache, v_cache, scale) in zip(pieces, self.holes[tokens]):
            piece.replay()
            _attend_into(out, q, k_cache, v_cache, scale, meta, backend)
        pieces[-1].replay()
        return self.outputs[tokens][:n]
