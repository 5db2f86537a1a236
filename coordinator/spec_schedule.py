"""Who gets n-gram drafts this step, and how a sequence's proposals back off when they fail.

A draft must follow the sequence's last token, so a verify row needs every token known: with async scheduling a
decoding sequence always has a token in flight, and dropping out of the overlap costs a step's worth of it. So a try
with tokens in flight first probes the known tokens (numpy only, no cost to the workers): a probe that finds nothing
is retried CHEAP_RETRY steps later; one that finds a match holds the sequence back until its in-flight tokens are
known, and the proposal then made is verified. A costly failure (held for nothing, or no draft accepted) waits 1, 2,
4 .. MAX_BACKOFF steps before the next try, decoding asynchronously meanwhile; any accepted draft resets the back-off
(it paid: try again at once).

EAGLE-3 drafts are made on the workers: a try holds the sequence until its in-flight tokens are known, then sends a
verify row of DRAFT_PLACEHOLDER tokens that the workers fill; the same back-off applies."""

from __future__ import annotations

import numpy as np

from coordinator.ngram import known_tokens, propose_batch
from coordinator.sequence import Sequence
from coordinator.speculative import SpecStats, SpeculativeConfig
from protocol.messages import DRAFT_PLACEHOLDER
from settings.env import settings

# Steps between tries at most: a failing sequence leaves the async overlap once per this many tokens at most.
MAX_BACKOFF = 64
CHEAP_RETRY = 2  # steps between proposals that cost nothing but the proposer's numpy when they find nothing


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self.accept_all = settings().bench_accept_drafts  # benchmark only: the ceiling, every try drafts

    def eligible(self, seq: Sequence) -> bool:
        """Decoding with controls the worker applies per position alone, past min_tokens, and room for a draft."""
        p = seq.params
        if seq.spec_ok is None:
            seq.spec_ok = (
                p.repetition_penalty == 1
                and p.frequency_penalty == 0
                and p.presence_penalty == 0
                and p.structured_outputs is None
            )
        return (
            seq.spec_ok
            and seq.num_computed_tokens == seq.num_tokens - 1  # decoding: only the last token to compute
            and seq.num_output_tokens >= max(1, p.min_tokens)
            and seq.num_tokens + 1 < min(seq.max_num_tokens, self.max_model_len + 1)
        )

    def plan(self, running: list[Sequence], step_id: int) -> tuple[dict[Sequence, np.ndarray], set[Sequence]]:
        """This step's drafts per sequence (never empty), and the sequences held back until their in-flight
        tokens are known (a probe found a match)."""
        drafts: dict[Sequence, np.ndarray] = {}
        held: set[Sequence] = set()
        cfg = self.cfg
        if len(running) > cfg.disable_by_batch_size:
            return drafts, held
        ready, probe = [], []
        for seq in running:
            if not seq.verify_drafts and seq.spec_next_try <= step_id and self.eligible(seq):
                (probe if seq.num_pending else ready).append(seq)
        lo, hi, k = cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens
        if cfg.method == "eagle3":
            return self.plan_on_workers(ready, probe), held.union(probe)
        if probe:
            known = [known_tokens(s, s.num_known_tokens) for s in probe]
            found = self.propose(known, [k] * len(probe), lo, hi)
            for seq, d in zip(probe, found):
                if len(d):
                    held.add(seq)
                    seq.spec_held = True
                else:
                    seq.spec_next_try = step_id + CHEAP_RETRY
        if ready:
            caps = [min(k, *self.caps(s)) for s in ready]
            known = [known_tokens(s, s.num_tokens) for s in ready]
            for seq, d in zip(ready, self.propose(known, caps, lo, hi)):
                if len(d):
                    drafts[seq] = d
                elif seq.spec_held:
                    self.backoff(seq, step_id)
                else:
                    seq.spec_next_try = step_id + CHEAP_RETRY
                seq.spec_held = False
        return drafts, held

    def plan_on_workers(self, ready: list[Sequence], probe: list[Sequence]) -> dict[Sequence, np.ndarray]:
        """EAGLE-3: placeholders for the drafts the workers make, for every sequence whose tokens are all known;
        the others are held until theirs are."""
        for seq in probe:
            seq.spec_held = True
        drafts = {}
        for seq in ready:
            cap = min(self.cfg.num_speculative_tokens, *self.caps(seq))
            if cap > 0:
                drafts[seq] = np.full(cap, DRAFT_PLACEHOLDER, np.int32)
            seq.spec_held = False
        return drafts

    def caps(self, seq: Sequence) -> tuple[int, int]:
        """1 + d tokens come back at most: d <= max_tokens left - 1, and the last position < max_model_len."""
        return seq.max_num_tokens - seq.num_tokens - 1, self.max_model_len - seq.num_tokens

    def propose(self, known: list[np.ndarray], caps: list[int], lo: int, hi: int) -> list[np.ndarray]:
        found = propose_batch(known, caps, lo, hi)
        if self.accept_all:  # benchmark only: where no n-gram matches, the last token repeated
            found = [d if len(d) else np.full(max(cap, 0), t[-1], np.int32) for d, t, cap in zip(found, known, caps)]
        return found

    @staticmethod
    def backoff(seq: Sequence, step_id: int) -> None:
        seq.spec_backoff = min(max(1, 2 * seq.spec_backoff), MAX_BACKOFF)
        seq.spec_next_try = step_id + seq.spec_backoff

    def verified(self, seq: Sequence, accepted: int, step_id: int) -> None:
        """Its verify row came back with ``accepted`` drafts taken."""
        seq.verify_drafts = 0
        if accepted:
            seq.spec_backoff = seq.spec_next_try = 0
        else:
            self.backoff(seq, step_id)
