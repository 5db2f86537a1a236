"""The host-side layout of one step, as the model runner builds it: its flat inputs (HostBatch) and, for a step
with draft tokens, where each output position sits (VerifyLayout). Records only, shared by the runner and the
modules it is built from (worker/step_sampling.py, worker/speculative.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class VerifyLayout:
    """The output positions of a step with verify rows, on the host: per sampled row 1 + d of them (d = 0 for an
    ordinary row), rows in order."""

    counts: np.ndarray  # [m] positions of each sampled row (1 + d)
    drafts: np.ndarray  # [m] d of each sampled row
    out_rows: np.ndarray  # [S] token row of each position (its logits predict the next token)
    out_slots: np.ndarray  # [S]
    out_positions: np.ndarray  # [S] the position of the token sampled there
    plain: np.ndarray  # sampled-row indices of the ordinary rows
    plain_pos: np.ndarray  # their output positions
    verify: np.ndarray  # sampled-row indices of the verify rows
    verify_pos: np.ndarray  # [P] their output positions, rows in order
    verify_drafts: np.ndarray  # [P] the draft scored at each, -1 at a row's last
    owner: np.ndarray  # [P] index among the verify rows
    offset: np.ndarray  # [P] index j within the row


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
    verify: VerifyLayout | None = None  # a step with draft tokens (speculative decoding): its output positions
    # a step of verify and decode rows only, attended as one decode row per token: (slot, context length) of each
    token_rows: tuple[np.ndarray, np.ndarray] | None = None

    def attention_rows(self, block_tables: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's attention sequences, prefill chunks then decode rows (one query each): (queries, context
        length, block-table row) of each, for the whole-step attention of worker/prefill_graphs.py."""
        n_pre = self.num_prefills
        decode_slots, decode_lens = self.decode_rows()
        q_lens = np.concatenate([self.q_lens[:n_pre], np.ones(len(decode_slots), dtype=np.int64)])
        seq_lens = np.concatenate([self.seq_lens[:n_pre], decode_lens])
        slots = np.concatenate([self.slots[:n_pre], decode_slots])
        return q_lens, seq_lens, block_tables[slots, : self.width]

    def decode_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The (slot, context length) of each decode row the attention reads for."""
        if self.token_rows is not None:
            return self.token_rows
        return self.slots[self.num_prefills :], self.seq_lens[self.num_prefills :]
