"""Sampling controls that read their SamplingParams field themselves, as vLLM's logits processors do.

A processor keeps its own per-slot state, set from the records of the sequences that start in slots, and turns
the step's sampled rows into a change of their logits. ``SamplingState`` calls every processor of ``PROCESSORS``
(``start``, ``free``, ``prepare``) and the sampler applies what ``prepare`` returned (``apply``), after the logit
bias, min_tokens masks and penalties, before structured outputs' masks. A processor costs one flag check a step
while no running sequence uses it (``active``). A new sampling field applied here is its record's field
(protocol/sampling_params.py), its HTTP schema field if any, and a processor in this file: nothing else changes.

Processors run on rank 0, which samples whenever some slot uses one (``SamplingState.any_controls``); every rank
tracks which slots use one, so that all ranks take the same sampling path.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

import numpy as np
import torch

from comm.parallel import tp_rank
from protocol.sampling_params import SamplingParams

ToDevice = Callable[..., torch.Tensor]  # (numpy array, torch dtype = int64) -> device tensor


class LogitsProcessor:
    """One control: which slots use it (``used``, on every rank) and its own state (rank 0)."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device, to_dev: ToDevice) -> None:
        self.vocab_size, self.device, self.to_dev = vocab_size, device, to_dev
        self.used = np.zeros(max_num_seqs, dtype=bool)

    @property
    def active(self) -> bool:
        return bool(self.used.any())

    def uses(self, params: SamplingParams) -> bool:
        """Whether a sequence with these settings needs this processor."""
        raise NotImplementedError

    def start(self, slots: np.ndarray, params: list[SamplingParams]) -> None:
        """Sequences starting in ``slots``: mark those that use it and, on rank 0, set their state."""
        used = np.fromiter(map(self.uses, params), bool, len(params))
        self.used[slots] = used
        if used.any() and tp_rank() == 0:
            self.set_slots(slots[used], [p for p, u in zip(params, used) if u])

    def set_slots(self, slots: np.ndarray, params: list[SamplingParams]) -> None:
        """Rank 0: the state of the sequences that use it, starting in ``slots``."""

    def free(self, slots: np.ndarray) -> None:
        self.used[slots] = False

    def prepare(self, sample_slots: np.ndarray) -> object | None:
        """What ``apply`` needs for this step's sampled rows (in ``sample_slots``' order), or None if no row uses
        it. Host side, a few numpy calls."""
        rows = np.flatnonzero(self.used[sample_slots])
        return (self.to_dev(rows), self.to_dev(sample_slots[rows])) if len(rows) else None

    def apply(self, logits: torch.Tensor, prepared) -> torch.Tensor:
        """The step's float32 logits [rows, vocab] changed (in place allowed: the sampler passes its own copy)."""
        raise NotImplementedError


class AllowedTokenIds(LogitsProcessor):
    """vLLM's ``allowed_token_ids``: a sequence samples only among its listed ids. Rank 0 keeps a bool mask
    [max_num_seqs, vocab], allocated when the first such sequence arrives, so a step gathers its rows' masks in one
    index and never rebuilds them."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device, to_dev: ToDevice) -> None:
        super().__init__(max_num_seqs, vocab_size, device, to_dev)
        self.mask: torch.Tensor | None = None

    def uses(self, params: SamplingParams) -> bool:
        return params.allowed_token_ids is not None

    def set_slots(self, slots: np.ndarray, params: list[SamplingParams]) -> None:
        if self.mask is None:
            self.mask = torch.zeros((len(self.used), self.vocab_size), dtype=torch.bool, device=self.device)
        ids = [p.allowed_token_ids for p in params]
        counts = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(chain.from_iterable(ids), np.int64, int(counts.sum()))
        self.mask[self.to_dev(slots)] = False
        self.mask[self.to_dev(np.repeat(slots, counts)), self.to_dev(flat)] = True

    def apply(self, logits: torch.Tensor, prepared) -> torch.Tensor:
        rows, slots = prepared
        logits[rows] = logits[rows].masked_fill(~self.mask[slots], -torch.inf)
        return logits


PROCESSORS: tuple[type[LogitsProcessor], ...] = (AllowedTokenIds,)
