"""EAGLE-3 drafts on the worker, beside the target: every rank runs the same replicated draft on the same inputs (no
collectives), so every rank fills the same drafts into a step's verify rows.

Where the draft's state lives:
- its K/V: a pool of its own, indexed by the TARGET's block ids and slots (the block manager's blocks hold both), so
  preemption, prefix sharing and block reuse need nothing new. The draft's K/V at position p is computed from
  (the target's features at p, the token at p + 1).
- the target's features: the residual streams entering three target layers, written by the target's forward into a
  static buffer (model/decoder.py ``aux_outs``), so the decode CUDA graphs write them on replay too.
- per slot: the first draft (the draft's guess for the token after the slot's last emitted one) and the draft's
  hidden state there (``prenorm``), which seeds the next draft steps.

Each step, after its tokens are known on every rank (``catch_up``): one draft forward over every token the target
computed, the token input being the next one (within a row the step's next input, at a sampled position the token
emitted there); then each sampled row's first draft and hidden state are kept. A later step's verify row
[last token, DRAFT_PLACEHOLDER x d] is filled before the target's forward (``fill``): draft 1 is the kept one,
draft j + 1 comes from one more draft forward at position p0 + j - 1 (p0: the row's first position) on draft j and
the previous hidden state: decode rows of one token each, whose K/V lands inside the verify row's own blocks. With
the target's CUDA graphs, both run as graphs of their own at low batch (worker/eagle_graphs.py)."""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention import AttentionMetadata, value_cache
from model.context import forward_context
from model.eagle3 import load_eagle3
from model.eagle3_config import read_eagle3
from protocol.messages import DRAFT_PLACEHOLDER, StepCommand
from worker import lazy_zeros
from worker.step_layout import HostBatch


class EagleDrafter:
    def __init__(self, runner, draft_dir: str) -> None:
        cfg = runner.cfg
        self.runner = runner
        self.config = read_eagle3(draft_dir, runner.model_config)  # the coordinator checked it too, before start
        target_embed = runner.model.model.embed_tokens.weight
        max_position = max(self.config.max_position_embeddings, cfg.max_model_len + 1)
        self.model = load_eagle3(self.config, target_embed, cfg.model, runner.device, runner.dtype, max_position)
        self.attn = self.model.attn
        # the target's three features per token of a forward (the largest forward: a step's token budget)
        rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        h = runner.model_config.hidden_size
        self.aux = torch.zeros(rows, 3 * h, dtype=runner.dtype, device=runner.device)
        layers = runner.model.model.layers
        for i, layer_id in enumerate(self.config.aux_layer_ids):
            layers[layer_id].aux_outs = (*layers[layer_id].aux_outs, self.aux[:, i * h : (i + 1) * h])
        n = cfg.max_num_seqs
        self.first = torch.zeros(n, dtype=torch.int64, device=runner.device)
        self.hidden = torch.zeros(n, self.config.hidden_size, dtype=runner.dtype, device=runner.device)
        self.graphs = None  # CUDA graphs of its forwards at low batch (worker/eagle_graphs.py), once captured

    def capture_graphs(self, pool=None, capture: bool = True) -> None:
        """After the K/V pool exists; ``pool``: the target's decode graphs' memory pool. ``capture=False``: the
        same static buffers run eagerly (CPU tests)."""
        from worker.eagle_graphs import DraftGraphs

        self.graphs = DraftGraphs(self, pool, capture)

    # ---- its K/V, parallel to the target's blocks ----------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        r = self.runner
        return 2 * self.attn.num_kv_heads * self.attn.head_dim * r.kv_dtype.itemsize * r.block_size

    def allocate(self, num_blocks: int) -> None:
        r, a = self.runner, self.attn
        shape = (2, num_blocks, r.block_size, a.num_kv_heads, a.head_dim)
        self.kv = lazy_zeros.zeros(shape, r.kv_dtype, r.device)  # CPU: pages committed as written
        a.k_cache, a.v_cache = self.kv[0], value_cache(self.kv[1])

    # ---- after a step: the draft's K/V over the step's tokens, and each sampled row's first draft --------------

    @torch.inference_mode()
    def catch_up(
        self,
        hb: HostBatch,
        ids: torch.Tensor,
        out_rows: np.ndarray,
        emitted: torch.Tensor | None,
        last_rows: torch.Tensor | None,
    ) -> None:
        """``ids``: the step's input tokens (device); ``out_rows``: the token rows whose next token was sampled,
        ``emitted`` the token there; ``last_rows``: per sampled row, the token row of its last emitted token."""
        r = self.runner
        num = len(ids)
        if num > len(self.aux):
            raise RuntimeError(f"a forward of {num} tokens exceeds the EAGLE-3 feature buffer ({len(self.aux)} rows)")
        nxt = torch.roll(ids, -1)  # within a row, the next input; a chunk's last token's successor is unknown
        if emitted is not None:
            nxt[r.to_dev(out_rows)] = emitted
        graphed = self.graphs.catch_up(nxt, hb) if self.graphs is not None else None
        if graphed is None:
            with forward_context(r.device_meta(hb), r.backend):
                normed, prenorm = self.model(nxt, r.to_dev(hb.positions), self.model.fuse(self.aux[:num]))
        else:
            tokens, prenorm = graphed  # every token's greedy draft, computed in the graph
        if last_rows is not None and len(last_rows):
            slots = r.to_dev(hb.sample_slots)
            self.hidden[slots] = prenorm[last_rows]
            self.first[slots] = self.model.greedy(normed[last_rows]) if graphed is None else tokens[last_rows]

    # ---- before a step: its verify rows' draft positions ------------------------------------------------------

    @torch.inference_mode()
    def fill(self, step: StepCommand, hb: HostBatch, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with every DRAFT_PLACEHOLDER of the step's verify rows replaced by this worker's drafts."""
        r = self.runner
        d = np.zeros(len(hb.slots), dtype=np.int64)
        d[: len(step.draft_counts)] = step.draft_counts
        rows = np.flatnonzero(d > 0)
        rows = rows[step.token_ids[hb.cu[rows] + 1] == DRAFT_PLACEHOLDER]
        if not len(rows):
            return ids
        d, base = d[rows], hb.cu[rows]
        slots, p0 = hb.slots[rows], hb.positions[base]
        filled = self.graphs.fill(ids, slots, p0, d, base) if self.graphs is not None else None
        if filled is not None:
            return filled
        slots_dev = r.to_dev(slots)
        tokens, hidden = self.first[slots_dev], self.hidden[slots_dev]
        ids = ids.clone()
        ids[r.to_dev(base + 1)] = tokens
        for j in range(1, int(d.max())):
            act = np.flatnonzero(d > j)  # rows that still need draft j + 1
            act_dev = r.to_dev(act)
            pos = p0[act] + j - 1
            with forward_context(self._decode_meta(slots[act], pos), r.backend):
                normed, prenorm = self.model(tokens[act_dev], r.to_dev(pos), hidden[act_dev])
            tokens[act_dev] = self.model.greedy(normed)
            hidden[act_dev] = prenorm
            ids[r.to_dev(base[act] + 1 + j)] = tokens[act_dev]
        return ids

    def _decode_meta(self, slots: np.ndarray, pos: np.ndarray) -> AttentionMetadata:
        """One decode row per slot, its token at ``pos``: written there, attending to positions 0..pos."""
        r = self.runner
        bs = r.block_size
        mapping = r.block_tables[slots, pos // bs].astype(np.int64) * bs + pos % bs
        lens = pos + 1
        meta = AttentionMetadata(
            slot_mapping=r.to_dev(mapping), num_prefill_tokens=0, num_prefills=0, num_decodes=len(slots)
        )
        r.set_decode_meta(meta, slots, lens, -(-int(lens.max()) // bs))
        return meta
