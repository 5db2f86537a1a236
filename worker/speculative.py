"""A step with verify rows (speculative decoding, StepCommand.draft_counts): where its logits are, how its rows are
sampled, and what every rank learns from it.

A verify row computes [last token, d drafts] and needs logits at all 1 + d positions; an ordinary row only at its
last. ``verify_layout`` lists those positions on the host once per such step (steps without drafts never come
here). Rank 0 samples the ordinary rows exactly as a step without drafts would and runs the rejection sampler
(worker/rejection_sampler.py) over every verify position at once; the logits of those rows are gathered to rank 0
under tensor parallelism (``compute_logits``), since acceptance, residuals and top-k / top-p need the whole
vocabulary's distribution at each position. Rank 0 broadcasts the tokens of every position and the accepted
counts; each rank then feeds each row's last emitted token into the next step (the async feed) and, before its
next step, moves the slot's computed length back over the rejected drafts (``settle``)."""

from __future__ import annotations

import numpy as np
import torch

from comm.parallel import broadcast_from_rank0, tp_rank
from protocol.messages import StepCommand
from worker.logprobs import gather_logprobs, raw_logprobs
from worker.rejection_sampler import verify
from worker.results import AwaitingMasks, PendingTokens, VerifyCompaction, no_tokens
from worker.sampler import sample
from worker.step_layout import HostBatch, VerifyLayout


def add_verify_rows(hb: HostBatch, step: StepCommand, max_decode_rows: int) -> None:
    """A step with drafts: its layout, and logits at every output position (``sample_idx``). Without a prefill
    chunk and with at most ``max_decode_rows`` tokens, each token is attended as a decode row of its own (context:
    up to its position, through its sequence's block table), so the step replays a whole-forward decode graph:
    every layer stores the step's K/V before it attends, so a draft sees the drafts before it."""
    sampled = np.arange(len(hb.slots))
    if len(step.skip_sample_rows):
        sampled = np.delete(sampled, step.skip_sample_rows)
    hb.verify = verify_layout(step, sampled, hb.cu, hb.positions)
    hb.sample_idx = hb.verify.out_rows
    if len(hb.positions) <= max_decode_rows and (step.prefill_num_tokens == step.draft_counts + 1).all():
        hb.token_rows = (np.repeat(hb.slots, hb.q_lens), hb.positions + 1)
        hb.num_prefills = 0


def verify_layout(step: StepCommand, sampled: np.ndarray, cu: np.ndarray, positions: np.ndarray) -> VerifyLayout:
    """``sampled``: the step rows that are sampled, ascending; ``cu``/``positions``: the step's token offsets and
    token positions."""
    d_rows = np.zeros(len(cu) - 1, dtype=np.int64)
    d_rows[: len(step.draft_counts)] = step.draft_counts
    d = d_rows[sampled]
    counts = d + 1
    total = int(counts.sum())
    owner_all = np.repeat(np.arange(len(sampled)), counts)
    offset_all = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    out_rows = np.repeat(cu[sampled + 1] - 1 - d, counts) + offset_all
    next_ids = step.token_ids[np.minimum(out_rows + 1, len(step.token_ids) - 1)].astype(np.int64)
    is_verify = d[owner_all] > 0
    verify_pos = np.flatnonzero(is_verify)
    rows_verify = np.flatnonzero(d > 0)
    index_of = np.cumsum(d > 0) - 1  # a sampled row's index among the verify rows
    offset = offset_all[verify_pos]
    return VerifyLayout(
        counts=counts,
        drafts=d,
        out_rows=out_rows,
        out_slots=np.repeat(step.slots[sampled].astype(np.int64), counts),
        out_positions=positions[out_rows] + 1,
        plain=np.flatnonzero(d == 0),
        plain_pos=np.flatnonzero(~is_verify),
        verify=rows_verify,
        verify_pos=verify_pos,
        verify_drafts=np.where(offset < d[owner_all[verify_pos]], next_ids[verify_pos], -1),
        owner=index_of[owner_all[verify_pos]],
        offset=offset,
    )


def _plain_mask_rows(lay: VerifyLayout, mask_rows: np.ndarray) -> np.ndarray:
    """Structured outputs' rows (among the step's sampled rows) as rows among its ordinary ones."""
    index = np.full(len(lay.counts), -1, dtype=np.int64)
    index[lay.plain] = np.arange(len(lay.plain))
    rows = index[mask_rows]
    if (rows < 0).any():
        raise ValueError("a verify row has a structured-output mask: drafts are proposed only for unmasked rows")
    return rows


class SpeculativeSteps:
    """ModelRunner's verify steps (a mixin: ``self`` is the runner, which also brings StepSampling)."""

    def launch_verify(
        self, step: StepCommand, hb: HostBatch, hidden: torch.Tensor, rows: torch.Tensor, slots_dev, prompt
    ) -> PendingTokens | AwaitingMasks:
        """Sample a step with verify rows from the hidden states of its output positions (``rows``)."""
        lay, state = hb.verify, self.sampling
        noise_seed = int(self.noise_seeds.integers(1 << 31))  # drawn on every rank, as every step does
        logits = self.model.compute_logits(rows)  # the whole vocabulary on rank 0 (gathered), None elsewhere
        packed_len = len(lay.out_rows) + len(lay.counts)
        if tp_rank() != 0:
            packed = broadcast_from_rank0(torch.empty(packed_len, dtype=torch.int64, device=self.device))
            self._feed(hb, slots_dev, packed)
            self.prompt_logprobs_of(hidden, prompt)  # a collective under tensor parallelism
            return no_tokens(step.step_id)
        masked = step.mask_rows is not None and len(step.mask_rows) > 0

        def pick(masks: np.ndarray | None) -> PendingTokens:
            to_dev = self.to_dev
            tokens = torch.empty(len(lay.out_rows), dtype=torch.int64, device=self.device)
            accepted = torch.zeros(len(lay.counts), dtype=torch.int64, device=self.device)
            if len(lay.plain):  # ordinary rows: exactly the sampling of a step without drafts
                plain_slots = hb.sample_slots[lay.plain]
                st = state.tensors(plain_slots, hb.sample_positions[lay.plain])
                if masked and masks is not None:
                    words = masks.reshape(len(step.mask_rows), -1)
                    st.allowed = (to_dev(_plain_mask_rows(lay, step.mask_rows)), to_dev(words, torch.int32))
                plain_dev = to_dev(lay.plain_pos)
                picked = sample(logits[plain_dev], st, self.generator, noise_seed)
                if state.any_controls:
                    state.after_sample(st, plain_slots, slots_dev[to_dev(lay.plain)], picked)
                tokens[plain_dev] = picked
            if len(lay.verify):
                vpos = to_dev(lay.verify_pos)
                st = state.tensors(lay.out_slots[lay.verify_pos], lay.out_positions[lay.verify_pos])
                grid = (len(lay.verify), int(lay.drafts.max()) + 1)
                owner = to_dev(lay.owner)
                drafts = to_dev(lay.verify_drafts) if self.drafter is None else self._filled_drafts(lay)
                emitted, num = verify(
                    logits[vpos], st, drafts, owner, to_dev(lay.offset), grid, self.generator, self.accept_all_drafts
                )
                tokens[vpos] = emitted
                accepted[to_dev(lay.verify)] = num
                if state.any_controls:
                    kept = to_dev(lay.offset) <= num[owner]
                    state.after_verify(lay.out_slots[lay.verify_pos], emitted, kept)
            packed = broadcast_from_rank0(torch.cat([tokens, accepted]))
            self._feed(hb, slots_dev, packed)
            prompt_result = self.prompt_logprobs_of(hidden, prompt)
            lp, entries = None, None
            num_logprobs = state.num_logprobs[lay.out_slots] if state.any_controls else None
            raw = raw_logprobs(logits, num_logprobs, to_dev) if num_logprobs is not None else None
            if raw is not None:  # every position's token and top N; the host keeps the emitted ones
                lp = gather_logprobs(*raw, num_logprobs, tokens, to_dev)
                entries = np.where(num_logprobs >= 0, num_logprobs + 1, 0)
            compaction = VerifyCompaction(lay.counts, entries)
            return self.results.pending(step.step_id, packed, *(lp or ()), prompt=prompt_result, verify=compaction)

        if masked and step.token_masks is None:
            return AwaitingMasks(step.step_id, pick)
        return pick(step.token_masks)

    def _filled_drafts(self, lay: VerifyLayout) -> torch.Tensor:
        """The draft scored at each verify position as the forward read it (EAGLE-3: filled on this worker, the
        step command holds placeholders), -1 at a row's last position."""
        has = lay.verify_drafts != -1
        rows = np.where(has, lay.out_rows[lay.verify_pos] + 1, 0)
        return torch.where(self.to_dev(has.astype(np.int64)) > 0, self.step_ids[self.to_dev(rows)], -1)

    def _feed(self, hb: HostBatch, slots_dev: torch.Tensor, packed: torch.Tensor) -> None:
        """Every rank: each sampled row's last emitted token becomes its slot's next input, and the accepted counts
        wait (on the device) until the next step needs the computed lengths (``settle``). With EAGLE-3 the draft
        then catches up over the step's tokens (worker/eagle_drafter.py)."""
        lay = hb.verify
        num_out = len(lay.out_rows)
        accepted = packed[num_out:]
        first = self.to_dev(np.cumsum(lay.counts) - lay.counts)
        self.last_tokens[slots_dev] = packed[first + accepted]
        self.unsettled = (hb.sample_slots[lay.verify], lay.drafts[lay.verify], accepted[self.to_dev(lay.verify)])
        if self.drafter is not None:  # each row's last emitted token: the row's position a
            last = self.to_dev(lay.out_rows)[first + accepted]
            self.drafter.catch_up(hb, self.step_ids, lay.out_rows, packed[:num_out], last)

    def settle(self) -> None:
        """Before the next step: each verify row's slot computed 1 + d tokens but keeps 1 + a (its KV at the rejected
        positions is overwritten later); min_tokens advance by the tokens emitted. Waits for the verify step's
        result (the host lays out the next step's positions from these lengths)."""
        slots, drafts, accepted = self.unsettled
        self.unsettled = None
        num = accepted.cpu().numpy()
        self.num_computed[slots] -= drafts - num
        if tp_rank() == 0 and self.sampling.any_controls:
            self.sampling.advance_min_tokens(slots, num + 1)
