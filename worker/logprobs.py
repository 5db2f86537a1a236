"""Logprobs of the sampled rows that ask for them (vLLM's default: the model's raw distribution, before logit bias,
penalties, temperature and filters), flattened as ``StepResult`` carries them: per row, the sampled token then
its top N. And prompt logprobs: per prompt token of a sequence with ``prompt_logprobs=N``, its raw logprob and
rank and the top N, computed from the rows of its prompt chunks (``PromptLogprobs``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from protocol.sampling_params import SamplingParams

ToDevice = Callable[..., torch.Tensor]
_PROMPT_ROWS_PER_PASS = 512  # bounds the [rows, vocab] float32 logits of one pass (~300 MB at 150k tokens)


def raw_logprobs(
    logits: torch.Tensor, num_logprobs: np.ndarray, to_dev: ToDevice
) -> tuple[np.ndarray, torch.Tensor] | None:
    """Rows asking for logprobs (``num_logprobs`` >= 0, one per sampled row) and the log-softmax of their raw
    logits; None when no row asks."""
    rows = np.flatnonzero(num_logprobs >= 0)
    if not len(rows):
        return None
    return rows, logits[to_dev(rows)].float().log_softmax(-1)


def _flatten(ids: torch.Tensor, values: torch.Tensor, n: np.ndarray, to_dev: ToDevice):
    """Row i's first ``1 + n[i]`` columns of ``ids``/``values`` [rows, 1 + max n], concatenated."""
    per_row = n + 1
    total = int(per_row.sum())
    cols = np.arange(total) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    flat = to_dev(np.repeat(np.arange(len(n)), per_row) * ids.shape[1] + cols)
    return ids.reshape(-1)[flat].to(torch.int32), values.reshape(-1)[flat]


def _with_top(logprobs: torch.Tensor, first: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, 1 + k] ids and logprobs: the token ``first`` (one per row) then the row's top k."""
    ids, values = first.unsqueeze(1), logprobs.gather(1, first.unsqueeze(1))
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        ids, values = torch.cat([ids, top_ids], 1), torch.cat([values, top_values], 1)
    return ids, values


def gather_logprobs(
    rows: np.ndarray, logprobs: torch.Tensor, num_logprobs: np.ndarray, tokens: torch.Tensor, to_dev: ToDevice
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (token ids int32, logprobs float32): per row of ``rows``, the sampled token then its top N, with N
    from ``num_logprobs`` (one per sampled row)."""
    n = num_logprobs[rows]
    ids, values = _with_top(logprobs, tokens[to_dev(rows)], int(n.max()))
    return _flatten(ids, values, n, to_dev)


@dataclass(slots=True)
class PromptRows:
    """One step's token rows whose logits predict a prompt token of a sequence asking for prompt logprobs."""

    token_rows: np.ndarray  # index into the step's hidden states (one per prompt position returned)
    index: np.ndarray  # [rows, 3] int32: step row, position in the prompt of the predicted token, 0 (for the rank)
    targets: np.ndarray  # the predicted prompt token of each row
    num: np.ndarray  # N (top alternatives) of each row's sequence


class PromptLogprobs:
    """Which running sequences still want prompt logprobs, and their prompts (sent by the coordinator with the
    sequence's start while it has no outputs: the last row of a chunk predicts the first token of the next one).
    A sequence restarted after a preemption computes them again from its first recomputed position; the
    coordinator keeps the first copy of a position. Every rank keeps this state (the logits of these rows are a
    collective under tensor parallelism); rank 0 computes the logprobs."""

    def __init__(self) -> None:
        self.prompts: dict[int, tuple[np.ndarray, int]] = {}  # slot -> (prompt ids, N)

    def start(
        self,
        slots: np.ndarray,
        params: list[SamplingParams],
        num_outputs: np.ndarray,
        prompt_lens: np.ndarray,
        past_token_ids: np.ndarray,
    ) -> None:
        self.free(slots)  # a slot's previous sequence may have asked
        asking = [i for i, p in enumerate(params) if p.prompt_logprobs is not None]
        if not asking:  # the common case: one pass over the new records, nothing else
            return
        ends = np.cumsum(prompt_lens.astype(np.int64) + num_outputs)
        for i in asking:
            if num_outputs[i] == 0 and prompt_lens[i] > 1:
                begin = ends[i] - num_outputs[i] - prompt_lens[i]
                prompt = past_token_ids[begin : begin + prompt_lens[i]].copy()
                self.prompts[int(slots[i])] = (prompt, params[i].prompt_logprobs)

    def free(self, slots: np.ndarray) -> None:
        if self.prompts:
            for slot in slots.tolist():
                self.prompts.pop(slot, None)

    def rows(self, slots: np.ndarray, cu: np.ndarray, positions: np.ndarray) -> PromptRows | None:
        """This step's prompt-logprob rows (None: no row has any). A sequence whose prompt this step completes
        leaves the table. A loop over the asking sequences only: every other row costs one ``isin``."""
        if not self.prompts:
            return None
        asking = np.flatnonzero(np.isin(slots, np.fromiter(self.prompts, np.int64, len(self.prompts))))
        token_rows, index, targets, num = [], [], [], []
        for r in asking.tolist():
            slot = int(slots[r])
            prompt, n = self.prompts[slot]
            first, count = int(positions[cu[r]]), int(cu[r + 1] - cu[r])
            k = min(count, len(prompt) - 1 - first)  # rows at positions q < len(prompt) - 1 predict prompt[q + 1]
            if k > 0:
                token_rows.append(np.arange(cu[r], cu[r] + k))
                index.append(np.stack([np.full(k, r), np.arange(first + 1, first + 1 + k), np.zeros(k, int)], 1))
                targets.append(prompt[first + 1 : first + 1 + k])
                num.append(np.full(k, n))
            if first + count >= len(prompt):
                del self.prompts[slot]
        if not token_rows:
            return None
        return PromptRows(
            np.concatenate(token_rows),
            np.concatenate(index).astype(np.int32),
            np.concatenate(targets).astype(np.int64),
            np.concatenate(num).astype(np.int64),
        )

    @staticmethod
    def compute(
        logits_of: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor, pr: PromptRows, to_dev: ToDevice
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor] | None:
        """On rank 0 (None elsewhere): ``pr.index`` and, on the device, int32 [the rows' ranks, then the flat token
        ids] and the flat logprobs (per row the prompt token, then the top N); the ranks travel with the ids so
        that nothing here waits for the device. ``logits_of`` is the model's LM head (a collective under tensor
        parallelism: every rank calls it on the same rows), run over at most ``_PROMPT_ROWS_PER_PASS`` rows at a
        time."""
        ranks, ids, values = [], [], []
        for lo in range(0, len(pr.token_rows), _PROMPT_ROWS_PER_PASS):
            sl = slice(lo, lo + _PROMPT_ROWS_PER_PASS)
            logits = logits_of(hidden[to_dev(pr.token_rows[sl])])
            if logits is None:  # not rank 0
                continue
            logprobs = logits.float().log_softmax(-1)
            top_ids, top_values = _with_top(logprobs, to_dev(pr.targets[sl]), int(pr.num[sl].max()))
            # vLLM's rank: how many tokens are at least as likely as the prompt token (1 = the most likely)
            ranks.append((logprobs >= top_values[:, :1]).sum(-1).to(torch.int32))
            flat_ids, flat_values = _flatten(top_ids, top_values, pr.num[sl], to_dev)
            ids.append(flat_ids)
            values.append(flat_values)
        if not ids:
            return None
        return pr.index, torch.cat(ranks + ids), torch.cat(values)
