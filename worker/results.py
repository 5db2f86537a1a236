"""A launched step's sampled ids (and logprobs, prompt logprobs) on their way to the host, without waiting for the
device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

_MAX_LOGPROB_ENTRIES = 21  # per sequence: the sampled token and the top 20 (logprobs <= 20)


@dataclass(slots=True)
class VerifyCompaction:
    """A step with verify rows comes back as the tokens of every output position, then the accepted count of each
    sampled row; the host keeps the emitted positions (j <= a of each row) and their logprobs."""

    counts: np.ndarray  # [m] output positions of each sampled row (1 + d)
    entries: np.ndarray | None  # [positions] logprob entries of each (1 + N, 0 where the row asks none)

    def apply(self, pending: PendingTokens) -> None:
        total = int(self.counts.sum())
        tokens, accepted = pending.host[:total], pending.host[total:]
        offset = np.arange(total) - np.repeat(np.cumsum(self.counts) - self.counts, self.counts)
        keep = offset <= np.repeat(accepted, self.counts)
        pending.host, pending.num_accepted = tokens[keep], accepted.astype(np.int32)
        if self.entries is not None and pending.logprobs is not None:
            kept = np.repeat(keep, self.entries)
            pending.logprob_token_ids, pending.logprobs = pending.logprob_token_ids[kept], pending.logprobs[kept]


@dataclass(slots=True)
class PendingTokens:
    """A launched step's sampled ids: valid in ``host`` (and the logprob arrays, when some row asked for
    logprobs) once ``event`` (None = already done) has completed."""

    step_id: int
    event: torch.cuda.Event | None
    host: np.ndarray
    logprob_token_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    # prompt logprobs (worker/logprobs.py PromptLogprobs.compute): the host index, int32 [ranks, flat ids], values
    prompt_index: np.ndarray | None = None
    prompt_ints: np.ndarray | None = None
    prompt_values: np.ndarray | None = None
    # a step with verify rows: the accepted drafts per sampled row (StepResult.num_accepted), set by ``wait``
    num_accepted: np.ndarray | None = None
    verify: VerifyCompaction | None = None

    def prompt_result(self) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """StepResult's (prompt_logprob_index, prompt_logprob_token_ids, prompt_logprobs), once ``wait`` returned:
        the ranks that came back with the ids go into the index's last column."""
        if self.prompt_index is None:
            return None, None, None
        k = len(self.prompt_index)
        index = self.prompt_index.copy()
        index[:, 2] = self.prompt_ints[:k]
        return index.reshape(-1), self.prompt_ints[k:], self.prompt_values

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        if self.verify is not None:
            self.verify.apply(self)
            self.verify = None
        return self.host


@dataclass(slots=True)
class AwaitingMasks:
    """Rank 0's launched step whose token bitmasks (StepMasks) have not arrived: its forward and logits are
    enqueued; ``finish(token_masks)`` enqueues the sampling and returns the step's PendingTokens."""

    step_id: int
    finish: Callable[[np.ndarray | None], PendingTokens]


def no_tokens(step_id: int) -> PendingTokens:
    """A step that sampled nothing here (partial prefill chunks only, or a rank other than 0)."""
    return PendingTokens(step_id, None, np.zeros(0, dtype=np.int32))


def _to_pinned_host(t: torch.Tensor) -> np.ndarray:
    """An asynchronous device->host copy into new pinned memory (the array keeps it alive)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host.numpy()


class ResultRing:
    """Asynchronous device->host copies of each step's results into pinned buffers used in turn (allocating
    pinned memory per step is slow): a step's tokens are read before the fourth step after it launches, since at
    most three are in flight (coordinator async_depth <= 2). On CPU the results are simply converted."""

    def __init__(self, max_num_seqs: int, device: torch.device, num_buffers: int = 4) -> None:
        self.max_num_seqs, self.on_cuda = max_num_seqs, device.type == "cuda"
        self._tokens = [
            torch.empty(max_num_seqs, dtype=torch.int32, pin_memory=self.on_cuda) for _ in range(num_buffers)
        ]
        self._logprobs: list[tuple[torch.Tensor, torch.Tensor]] = []  # allocated when a row first asks
        self._index = 0

    def pending(
        self,
        step_id: int,
        tokens: torch.Tensor,
        lp_ids: torch.Tensor | None = None,
        lp_values: torch.Tensor | None = None,
        prompt: tuple[np.ndarray, torch.Tensor, torch.Tensor] | None = None,
        verify: VerifyCompaction | None = None,
    ) -> PendingTokens:
        """``prompt``: PromptLogprobs.compute's result, or None; ``verify``: how to read a step with verify rows
        (``tokens`` then holds every output position's token and the accepted counts)."""
        index, ints, values = prompt if prompt is not None else (None, None, None)
        if not self.on_cuda:
            if lp_ids is not None:
                lp_ids, lp_values = lp_ids.numpy(), lp_values.numpy()
            if prompt is not None:
                ints, values = ints.numpy(), values.numpy()
            host = tokens.to(torch.int32).numpy()
            return PendingTokens(step_id, None, host, lp_ids, lp_values, index, ints, values, verify=verify)
        lp_room = self.max_num_seqs * _MAX_LOGPROB_ENTRIES
        if verify is not None and (len(tokens) > self.max_num_seqs or (lp_ids is not None and len(lp_ids) > lp_room)):
            # a verify step's positions can outnumber the ring's rows: pinned memory for this step alone
            host = _to_pinned_host(tokens.to(torch.int32))
            if lp_ids is not None:
                lp_ids, lp_values = _to_pinned_host(lp_ids), _to_pinned_host(lp_values)
            if prompt is not None:
                ints, values = _to_pinned_host(ints), _to_pinned_host(values)
            event = torch.cuda.Event()
            event.record()
            return PendingTokens(step_id, event, host, lp_ids, lp_values, index, ints, values, verify=verify)
        self._index = (self._index + 1) % len(self._tokens)
        host = self._tokens[self._index][: len(tokens)]
        host.copy_(tokens, non_blocking=True)
        if lp_ids is not None:
            lp_ids, lp_values = self._logprobs_to_host(lp_ids, lp_values)
        if prompt is not None:  # sized by the step's prompt rows: pinned per step, only steps that have some pay
            ints, values = _to_pinned_host(ints), _to_pinned_host(values)
        event = torch.cuda.Event()
        event.record()
        return PendingTokens(step_id, event, host.numpy(), lp_ids, lp_values, index, ints, values, verify=verify)

    def _logprobs_to_host(self, ids: torch.Tensor, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Asynchronous copies of a step's logprobs into the ring slot of its tokens."""
        if not self._logprobs:
            size = self.max_num_seqs * _MAX_LOGPROB_ENTRIES
            self._logprobs = [
                (torch.empty(size, dtype=torch.int32, pin_memory=True), torch.empty(size, pin_memory=True))
                for _ in self._tokens
            ]
        host_ids, host_values = self._logprobs[self._index]
        host_ids, host_values = host_ids[: len(ids)], host_values[: len(values)]
        host_ids.copy_(ids, non_blocking=True)
        host_values.copy_(values, non_blocking=True)
        return host_ids.numpy(), host_values.numpy()
