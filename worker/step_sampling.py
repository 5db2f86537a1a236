"""The sampling half of an ordinary step, run on every rank after the forward: which rank samples (rank 0, or
every rank its vocabulary shard under tensor parallelism), the controls and bitmasks it applies, and the tokens and
logprobs it hands to the result ring. A step with verify rows goes through worker/speculative.py instead."""

from __future__ import annotations

import numpy as np
import torch

from comm.parallel import all_gather_stack, broadcast_from_rank0, tp_rank, tp_size
from protocol.messages import StepCommand
from worker.logprobs import PromptRows, gather_logprobs, raw_logprobs
from worker.results import PendingTokens, no_tokens
from worker.sampler import pick_across_shards, sample, samples_on_shards, shard_candidates
from worker.step_layout import HostBatch


class StepSampling:
    """ModelRunner's sampling half of an ordinary step (a mixin: ``self`` is the runner)."""

    @torch.inference_mode()
    def step_results(
        self,
        hb: HostBatch,
        slots_dev: torch.Tensor,
        hidden: torch.Tensor,
        prompt_rows: PromptRows | None,
        step: StepCommand,
        sampled: tuple[torch.Tensor, tuple | None],
    ) -> PendingTokens:
        """After sampling: the tokens become the slots' next inputs, and go to the host with the logprobs."""
        tokens, lp = sampled
        self.last_tokens[slots_dev] = tokens
        prompt = self.prompt_logprobs_of(hidden, prompt_rows)
        if tp_rank() != 0:
            return no_tokens(step.step_id)
        if lp is not None:
            num_logprobs = self.sampling.num_logprobs[hb.sample_slots]
            lp = gather_logprobs(*lp, num_logprobs, tokens, self.to_dev)
        return self.results.pending(step.step_id, tokens, *(lp or ()), prompt=prompt)

    def prompt_logprobs_of(self, hidden: torch.Tensor, prompt_rows: PromptRows | None) -> tuple | None:
        """The step's prompt logprobs on rank 0 (every rank runs the LM head on the same rows: a collective under
        tensor parallelism); None when no row asks."""
        if prompt_rows is None:
            return None
        return self.prompt_logprobs.compute(self.model.compute_logits, hidden, prompt_rows, self.to_dev)

    def sample_rows(self, rows: torch.Tensor, hb: HostBatch, slots_dev: torch.Tensor, step: StepCommand):
        """Every rank's copy of the sampled ids (int64 [rows]) and, on rank 0, the raw logprobs of the rows that
        ask for them. On rank 0, when the step's bitmasks follow: a function that takes them and returns those."""
        state = self.sampling
        masked = step.mask_rows is not None and len(step.mask_rows) > 0  # structured outputs: rank 0 samples
        noise_seed = int(self.noise_seeds.integers(1 << 31))  # drawn on every rank: shard sampling shares it
        # the controls (penalties, min_tokens, logprobs) live on rank 0; without them every rank can build st
        st = state.tensors(hb.sample_slots, hb.sample_positions) if tp_rank() == 0 or not state.any_controls else None
        if tp_size() > 1 and not (state.any_controls or masked) and samples_on_shards(self.device.type == "cuda", st):
            # same decision on every rank (same commands): each proposes its vocabulary shard's best per row
            local, start = self.model.compute_shard_logits(rows)
            candidates = shard_candidates(local, st, noise_seed, start, self.model_config.vocab_size)
            return pick_across_shards(all_gather_stack(candidates)), None
        logits = self.model.compute_logits(rows)
        if tp_rank() != 0:
            tokens = torch.empty(len(hb.sample_idx), dtype=torch.int64, device=self.device)
            return broadcast_from_rank0(tokens), None  # every rank feeds the same tokens into the next step

        def pick(masks: np.ndarray | None) -> tuple[torch.Tensor, tuple[np.ndarray, torch.Tensor] | None]:
            if masked and masks is not None:  # None: a step whose tokens are dropped (shutdown)
                words = masks.reshape(len(step.mask_rows), -1)
                st.allowed = (self.to_dev(step.mask_rows), self.to_dev(words, torch.int32))
            lp = raw_logprobs(logits, state.num_logprobs[hb.sample_slots], self.to_dev) if state.any_controls else None
            tokens = sample(logits, st, self.generator, noise_seed)
            if state.any_controls:
                state.after_sample(st, hb.sample_slots, slots_dev, tokens)
            return broadcast_from_rank0(tokens), lp

        return pick if masked and step.token_masks is None else pick(step.token_masks)
