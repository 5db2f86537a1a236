"""What to compute each step: continuous batching under a token budget, chunked prefill, and preemption by
recompute (newest first) when the KV pool runs out. Running sequences go first, so decodes are never starved by
new prompts; waiting ones are admitted in arrival order while budget, slots and blocks last. With speculative decoding
a decode may carry d draft tokens (coordinator/spec_schedule.py): a verify row of 1 + d tokens, its blocks reserved
for all of them, no async placeholder, and not rescheduled until its result (1 + accepted tokens) is applied."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from coordinator.block_manager import BlockManager
from coordinator.sequence import SeqStatus, Sequence
from coordinator.spec_schedule import Speculator
from protocol.messages import StepCommand


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prompt_tokens_scheduled: int = 0
    chunked_prefill_steps: int = 0


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]  # prefill-first, as in the step command
    num_tokens: list[int]
    sampled: list[Sequence]  # sequences whose next token this step produces
    step: StepCommand
    masks_due: bool = False  # its token bitmasks follow (StepMasks) once the steps before it are applied
    drafts: list[int] | None = None  # speculative decoding: per sampled row, its drafts (0: not a verify row)


@dataclass(slots=True)
class Scheduler:
    block_manager: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: bool = False  # sampled tokens become placeholders until their step's result arrives
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    free_slots: list[int] = field(default_factory=list)
    freed_slots: list[int] = field(default_factory=list)  # to tell the workers in the next step
    step_id: int = 0
    speculator: Speculator | None = None  # n-gram drafts (coordinator/spec_schedule.py); None: off
    # Tokens a step may carry in all while sequences decode (0: no cap; _prefill_cap). A decode step reads every weight
    # once, so up to a few hundred rows ride along at little cost; a whole prompt in one step stalls every stream.
    max_prefill_beside_decodes: int = 0

    def __post_init__(self) -> None:
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- leaving the running set ---------------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free_blocks(seq.block_table)
        seq.num_blocks_sent = seq.num_keyed_blocks = 0
        seq.last_block_key = -1
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            self.freed_slots.append(seq.slot)
            seq.slot = -1

    def preempt(self, seq: Sequence) -> None:
        """Back to the front of the queue; its KV is recomputed (cheaply, through the prefix cache) later."""
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.drop_pending()  # tokens of steps still in flight are not part of the result
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    # ---- one step ------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted = False
        bm = self.block_manager
        drafts, held = self.speculator.plan(self.running, self.step_id) if self.speculator else ({}, ())
        verify: dict[Sequence, list[int]] = {}
        prefill_left = self._prefill_cap(sum(map(len, drafts.values())))

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # its in-flight token is its last; its verify row is in flight; held until its tokens are known
            if (seq.num_pending and seq.all_sampled) or seq.verify_drafts or seq in held:
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 1:  # a prompt chunk (or a recompute after preemption)
                n = min(n, prefill_left)
                if n < 1:
                    i += 1
                    continue
                prefill_left -= n
            if drafts and (draft := drafts.get(seq)) is not None and budget > 1:
                verify[seq] = draft[: budget - 1].tolist()  # a decode (n = 1) that also scores its drafts
                n = 1 + len(verify[seq])
            # most decodes fit the blocks they hold: no allocation to try
            fits = seq.num_computed_tokens + n <= len(seq.block_table) * bm.block_size
            while not (fits or bm.allocate(seq.block_table, [], seq.num_computed_tokens + n)):
                victim = self.running.pop()  # newest
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chosen.append((seq, n))
                budget -= n
                i += 1
        for seq in [s for s in verify if s.status is not SeqStatus.RUNNING]:
            del verify[seq]  # preempted by a later sequence of this step

        # No preemption happens past this point, so every block keyed from here on is computed by this step.
        # Keying at schedule time lets a request admitted below (or in the next step) share a prefix that is
        # being computed now: each layer stores the whole step's K/V before any attention reads it.
        for seq, n in chosen:
            self._key_full_blocks(seq, seq.num_computed_tokens + n)

        # Admit waiting sequences (not in a step that had to preempt: the pool is full).
        while self.waiting and budget > 0 and not preempted and self.free_slots:
            seq = self.waiting[0]
            if seq.num_pending or seq.verify_drafts:
                break  # preempted with tokens still in flight: readmitted once they are known, in arrival order
            hits = bm.match_prefix(seq.token_ids)
            if seq.params.prompt_logprobs is not None and not seq.num_output_tokens:
                # prompt logprobs come from computed rows only (vLLM skips the prefix cache for them): a cache hit
                # may only cover positions an earlier admission computed before a preemption
                hits = hits[: seq.prompt_logprobs_upto // bm.block_size]
            cached = len(hits) * bm.block_size
            n = min(seq.num_tokens - cached, budget, prefill_left)
            if n < 1:
                break
            table: list[int] = []
            if not bm.allocate(table, hits, cached + n):
                break
            self.waiting.popleft()
            seq.block_table = table
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            seq.num_keyed_blocks, seq.last_block_key = len(hits), bm.blocks[hits[-1]].key if hits else -1
            seq.status = SeqStatus.RUNNING
            seq.slot, seq.new_in_slot = self.free_slots.pop(), True
            self.running.append(seq)
            self.stats.prefix_cache_hit_tokens += cached
            self._key_full_blocks(seq, cached + n)
            chosen.append((seq, n))
            budget -= n
            prefill_left -= n

        if not chosen:
            return None
        return self._build(chosen, verify)

    def _prefill_cap(self, draft_tokens: int) -> int:
        """Prompt tokens this step may take. While a sequence decodes: the cap less the step's decode rows (and the
        ``draft_tokens`` they verify), so the whole step fits ``max_prefill_beside_decodes`` tokens (a prefill
        graph's size: no padded rows) and costs about a decode step, but at least half the cap; a quarter of the
        prompt tokens not yet computed if more; a backlog over one step's budget (offline, a burst) takes it all."""
        cap, budget = self.max_prefill_beside_decodes, self.max_num_batched_tokens
        if not cap:
            return budget
        backlog, decode_rows = 0, 0
        for seq in self.running:
            rest = seq.num_tokens - seq.num_computed_tokens
            decode_rows += rest <= 1 or seq.num_computed_tokens >= seq.num_prompt_tokens
            backlog += rest if rest > 1 else 0
        if not decode_rows:
            return budget
        for seq in self.waiting:  # stops past one step's worth
            if backlog > budget:
                break
            backlog += seq.num_tokens - seq.num_computed_tokens
        return budget if backlog > budget else max(cap - decode_rows - draft_tokens, cap // 2, backlog // 4)

    def _build(self, chosen: list[tuple[Sequence, int]], verify: dict[Sequence, list[int]]) -> ScheduledBatch:
        chosen.sort(key=lambda c: c[1] == 1)  # prefill chunks first (stable), then single tokens
        seqs = [s for s, _ in chosen]
        num_tokens = [n for _, n in chosen]
        tokens: list[int] = []
        block_counts, block_ids, skip_sample_rows, sampled = [], [], [], []
        new = [s for s in seqs if s.new_in_slot]
        partial_prefill = False
        for row, (seq, n) in enumerate(chosen):
            start = seq.num_computed_tokens
            draft = verify.get(seq) if verify else None
            tokens.extend(seq.token_ids[start : start + n] if draft is None else [seq.token_ids[start], *draft])
            fresh = seq.block_table[seq.num_blocks_sent :]
            block_counts.append(len(fresh))
            block_ids.extend(fresh)
            seq.num_blocks_sent = len(seq.block_table)
            if start < seq.num_prompt_tokens and seq.params.prompt_logprobs is not None:  # decodes: one compare
                # the rows computed predict the prompt tokens start + 1 .. start + n (the last: an output)
                seq.prompt_logprobs_upto = max(seq.prompt_logprobs_upto, min(start + n, seq.num_prompt_tokens - 1))
            if start + n == seq.num_tokens or draft is not None:
                sampled.append(seq)
            else:
                skip_sample_rows.append(row)
                partial_prefill |= start + n < seq.num_prompt_tokens
        self.stats.steps += 1
        self.stats.chunked_prefill_steps += partial_prefill
        num_prefills = sum(n > 1 for n in num_tokens)
        step = StepCommand(
            step_id=self.step_id,
            slots=np.array([s.slot for s in seqs], np.int32),
            prefill_num_tokens=np.array(num_tokens[:num_prefills], np.int32),
            token_ids=np.array(tokens, np.int32),
            new_block_counts=np.array(block_counts, np.int32),
            new_block_ids=np.array(block_ids, np.int32),
            skip_sample_rows=np.array(skip_sample_rows, np.int32),
            new_slots=np.array([s.slot for s in new], np.int32),
            new_start_pos=np.array([s.num_computed_tokens for s in new], np.int32),
            new_params=[s.params for s in new],
            freed_slots=np.array(self.freed_slots, np.int32),
            **self._past_tokens(new),
            draft_counts=np.array([len(verify.get(s, ())) for s in seqs[:num_prefills]], np.int32) if verify else None,
        )
        self.step_id += 1
        self.freed_slots.clear()
        for seq, n in chosen:
            seq.new_in_slot = False
            seq.num_computed_tokens += n
        for seq, draft in verify.items():
            seq.verify_drafts = len(draft)  # its 1 + accepted tokens are known once the result is applied
        if self.async_scheduling:
            for seq in sampled:
                if not seq.verify_drafts:
                    seq.token_ids.append(-1)  # workers feed the real token into the next step themselves
                    seq.num_pending += 1
        drafts = [len(verify.get(s, ())) for s in sampled] if verify else None
        return ScheduledBatch(seqs, num_tokens, sampled, step, drafts=drafts)

    @staticmethod
    def _past_tokens(new: list[Sequence]) -> dict:
        """The tokens the sequences (re)starting in a slot already have, which only the coordinator knows: their
        outputs so far (after a preemption; min_tokens and penalties count them) and, under a repetition
        penalty or while its prompt logprobs are still to compute (no outputs yet), their prompt (prefix-cache
        hits are never computed on the workers; a chunk's last row predicts the next chunk's first token). A
        sequence is only admitted with every token known (a preempted one's in-flight token resolves before it
        is readmitted), so its outputs so far are exact."""
        num_outputs, prompt_lens, past = [], [], []
        for s in new:
            outputs = s.output_token_ids
            p = s.params
            needs_prompt = p.repetition_penalty != 1 or (p.prompt_logprobs is not None and not outputs)
            prompt = s.token_ids[: s.num_prompt_tokens] if needs_prompt else []
            num_outputs.append(len(outputs))
            prompt_lens.append(len(prompt))
            past.extend(prompt)
            past.extend(outputs)
        return dict(
            new_num_outputs=np.array(num_outputs, np.int32),
            new_prompt_lens=np.array(prompt_lens, np.int32),
            new_past_token_ids=np.array(past, np.int32),
        )

    def _key_full_blocks(self, seq: Sequence, num_computed: int) -> None:
        """Register the blocks that are full once ``num_computed`` tokens are in cache, counting only known
        tokens (a placeholder of an in-flight step gets keyed in a later step)."""
        known = min(num_computed, seq.num_known_tokens)
        if known // self.block_manager.block_size <= seq.num_keyed_blocks:
            return  # no block filled since the last step (most decodes)
        seq.num_keyed_blocks, seq.last_block_key = self.block_manager.register_full_blocks(
            seq.block_table, seq.token_ids, known, seq.num_keyed_blocks, seq.last_block_key
        )
