"""Logprobs of the sampled rows that ask for them (vLLM's default: the model's raw distribution, before
penalties, temperature and filters), flattened as ``StepResult`` carries them: per row, the sampled token then
its top N."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def raw_logprobs(
    logits: torch.Tensor, num_logprobs: np.ndarray, to_dev: Callable[..., torch.Tensor]
) -> tuple[np.ndarray, torch.Tensor] | None:
    """Rows asking for logprobs (``num_logprobs`` >= 0, one per sampled row) and the log-softmax of their raw
    logits; None when no row asks."""
    rows = np.flatnonzero(num_logprobs >= 0)
    if not len(rows):
        return None
    return rows, logits[to_dev(rows)].float().log_softmax(-1)


def gather_logprobs(
    rows: np.ndarray,
    logprobs: torch.Tensor,
    num_logprobs: np.ndarray,
    tokens: torch.Tensor,
    to_dev: Callable[..., torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (token ids int32, logprobs float32): per row of ``rows``, the sampled token then its top N, with N
    from ``num_logprobs`` (one per sampled row)."""
    n = num_logprobs[rows]
    k = int(n.max())
    sampled = tokens[to_dev(rows)].unsqueeze(1)
    ids, values = sampled, logprobs.gather(1, sampled)
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        ids, values = torch.cat([ids, top_ids], 1), torch.cat([values, top_values], 1)
    per_row = n + 1
    total = int(per_row.sum())
    cols = np.arange(total) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    flat = to_dev(np.repeat(np.arange(len(rows)), per_row) * (k + 1) + cols)
    return ids.reshape(-1)[flat].to(torch.int32), values.reshape(-1)[flat]
