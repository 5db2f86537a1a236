"""CUDA graphs for the EAGLE-3 draft's forwards (worker/eagle_drafter.py), so drafting at low batch costs device
time, not launches: eagerly, one draft forward is ~40 small kernels plus host work, ~1 ms a step at batch 1.

Two kinds of graph per batch bucket (worker/cuda_graphs.batch_buckets), captured after the target's decode graphs
into their memory pool:

- ``fill``: ONE draft step of a verify step's drafting: rows of one token each, draft j -> draft j + 1. The step
  counter j lives on the device (per row, in the static ``fill_in`` buffer) and the graph advances it, so the
  k - 1 steps of a fill are k - 1 replays with no host work between them: positions (p0 + j - 1), the slot mapping
  (a block-table lookup on the device), the context lengths and which rows still draft (d > j) are computed inside
  the graph, which writes drafts j and j + 1 into a static copy of the step's input ids. One graph for a whole fill
  would need k at capture (the worker is never told it) and a graph per k; a replay costs a few microseconds.
- ``catch_up``: the draft forward over a decode/verify-only step's tokens (at most one bucket's rows), with the
  greedy draft of every row; the caller keeps the sampled rows' ones.

Padding rows (past the step's rows, or rows with no draft left) write no K/V (slot -1) and read none (length 0);
their outputs land in a dump row or are never read. ``capture=False`` runs the same functions on the same static
buffers eagerly at each "replay" (the CPU tests, which check the padding and on-device indexing against the eager
drafter)."""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from model.context import forward_context
from worker.cuda_graphs import batch_buckets, graph_decode_meta
from worker.step_layout import HostBatch


class _Direct:
    """A graph's stand-in without CUDA: replaying runs the captured function."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class DraftGraphs:
    def __init__(self, drafter, pool=None, capture: bool = True) -> None:
        r = drafter.runner
        self.drafter, self.runner, self.model = drafter, r, drafter.model
        self.max_rows = r.cfg.max_num_seqs  # a fill's rows are sequences; a decode-laid step has <= this many tokens
        self.buckets = batch_buckets(self.max_rows)
        self.fill_replays = self.catch_up_replays = 0
        dev, n, h = r.device, self.max_rows, drafter.config.hidden_size
        # fill: per row (slot, first position p0, drafts d, token row of its last token, step j); padding d = 0
        self.fill_in = torch.zeros(5, n, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(n, h, dtype=r.dtype, device=dev)
        self.ids = torch.zeros(len(drafter.aux) + 1, dtype=torch.int64, device=dev)  # the step's ids + a dump row
        # catch_up: per token (id after it, position, slot, context length); its outputs per token
        self.catch_in = torch.zeros(4, n, dtype=torch.int64, device=dev)
        self.catch_in[2] = -1  # the warm-up pass writes no K/V
        self.catch_tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.catch_hidden = torch.zeros(n, h, dtype=r.dtype, device=dev)
        # the decode attention metadata both read (never at once); widest table, split count fixed for max length
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(n, r.block_tables.shape[1], dtype=torch.int32, device=dev)
        self.max_seq_len = r.cfg.max_model_len
        self.fill_graphs: dict[int, object] = {}
        self.catch_graphs: dict[int, object] = {}
        for bs in reversed(self.buckets):  # largest first: the smaller ones reuse its pool memory
            self.fill_graphs[bs], pool = self._capture(lambda bs=bs: self._fill_step(bs), pool, capture)
            self.catch_graphs[bs], pool = self._capture(lambda bs=bs: self._catch_up_step(bs), pool, capture)
        if capture:
            torch.cuda.synchronize(dev)

    def _capture(self, fn: Callable[[], None], pool, capture: bool):
        if not capture:
            return _Direct(fn), pool
        with torch.inference_mode():
            fn()  # compiles every kernel outside the capture (static inputs: all rows padding, nothing written)
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            fn()
        return graph, graph.pool()

    def _meta(self, bs: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        return graph_decode_meta(bs, slot_mapping, self.seq_lens, self.tables, self.max_seq_len)

    def bucket(self, rows: int) -> int | None:
        """The bucket that holds ``rows`` rows, or None (the caller runs eagerly)."""
        return self.buckets[bisect.bisect_left(self.buckets, rows)] if rows <= self.max_rows else None

    # ---- fill: one draft step, replayed k - 1 times ----------------------------------------------------------

    def _fill_step(self, bs: int) -> None:
        d_, model, block = self.drafter, self.model, self.runner.block_size
        slots, p0, d, base, j = self.fill_in[:, :bs]
        start = j == 1  # the first step starts from the kept first draft and hidden state
        tokens = torch.where(start, d_.first[slots], self.tokens[:bs])
        hidden = torch.where(start[:, None], d_.hidden[slots], self.hidden[:bs])
        active = d > j  # rows that still need draft j + 1
        pos = torch.where(active, p0 + j - 1, 0)  # inactive rows: position 0, inside every table and RoPE cache
        page = self.tables[:bs].gather(1, (pos // block)[:, None])[:, 0].long()
        self.slot_mapping[:bs].copy_(torch.where(active, page * block + pos % block, -1))
        self.seq_lens[:bs].copy_(torch.where(active, pos + 1, 0))
        with forward_context(self._meta(bs, self.slot_mapping), self.runner.backend):
            normed, prenorm = model(tokens, pos, hidden)
        new = model.greedy(normed)
        dump = len(self.ids) - 1
        where = torch.cat([torch.where(d >= j, base + j, dump), torch.where(active, base + 1 + j, dump)])
        self.ids.index_copy_(0, where, torch.cat([tokens, new]))  # drafts j and j + 1 (j: again, the same)
        self.tokens[:bs].copy_(new)
        self.hidden[:bs].copy_(prenorm)
        self.fill_in[4, :bs].add_(1)

    @torch.inference_mode()
    def fill(
        self, ids: torch.Tensor, slots: np.ndarray, p0: np.ndarray, d: np.ndarray, base: np.ndarray
    ) -> torch.Tensor | None:
        """``ids`` with the drafts of the rows (``slots``, first position ``p0``, ``d`` drafts, the token row
        ``base`` of their last token) written after each row's last token; None where no graph holds the step."""
        bs = self.bucket(len(slots))
        steps = int(d.max()) - 1
        if bs is None or steps < 1 or len(ids) >= len(self.ids):
            return None
        r, n = self.runner, len(slots)
        host = np.zeros((5, bs), dtype=np.int64)
        host[:4, :n] = (slots, p0, d, base)
        host[4] = 1
        width = -(-int((p0 + d).max()) // r.block_size)  # the last draft step attends up to p0 + d - 2
        self.fill_in[:, :bs].copy_(r.to_dev(host))
        self.tables[:n, :width].copy_(r.to_dev(r.block_tables[slots, :width], torch.int32))
        self.ids[: len(ids)].copy_(ids)
        graph = self.fill_graphs[bs]
        for _ in range(steps):
            graph.replay()
        self.fill_replays += steps
        return self.ids[: len(ids)].clone()  # the step keeps its ids (the draft's catch-up reads them later)

    # ---- catch_up: the draft forward over a decode/verify-only step's tokens ---------------------------------

    def _catch_up_step(self, bs: int) -> None:
        nxt, pos, slot_mapping, lens = self.catch_in[:, :bs]
        self.seq_lens[:bs].copy_(lens)
        model = self.model
        with forward_context(self._meta(bs, slot_mapping), self.runner.backend):
            normed, prenorm = model(nxt, pos, model.fuse(self.drafter.aux[:bs]))
        self.catch_tokens[:bs].copy_(model.greedy(normed))
        self.catch_hidden[:bs].copy_(prenorm)

    @torch.inference_mode()
    def catch_up(self, nxt: torch.Tensor, hb: HostBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per token of a step without prefill rows: (the draft's greedy next token, its hidden state), or None where
        no graph holds the step. ``nxt``: each token's successor (the draft's token input)."""
        n = len(nxt)
        bs = self.bucket(n)
        if bs is None or hb.num_prefills:
            return None
        r = self.runner
        rows, lens = hb.decode_rows()
        host = np.zeros((3, bs), dtype=np.int64)
        host[1] = -1
        host[:, :n] = (hb.positions, hb.slot_mapping, lens)
        self.catch_in[1:, :bs].copy_(r.to_dev(host))
        self.catch_in[0, :n].copy_(nxt)
        self.tables[:n, : hb.width].copy_(r.to_dev(r.block_tables[rows, : hb.width], torch.int32))
        self.catch_graphs[bs].replay()
        self.catch_up_replays += 1
        return self.catch_tokens[:n], self.catch_hidden[:n]
