"""Per-slot sampling state of a worker's running sequences, built from their SamplingParams records.

Every setting lives in a slot-indexed numpy array, filled once when a sequence starts in a slot (``start``: one
numpy call per field over the step's new records), so a step's controls are a few fancy-index gathers
(``tensors``). The optional controls (logit bias, min_tokens masks, penalties, logprobs) cost one flag check while
no running sequence uses them (``any_controls``). Logit biases live in one sparse (slot, token id, bias) table of
every running sequence that has one, rebuilt only when such a sequence starts or leaves, so a step gathers its
rows' entries with a few numpy calls and the sampler adds them with one ``index_put_``. Rank 0 also keeps the
penalties' device state: each penalized slot's output-token counts and prompt-token mask, updated after every
sample (``after_sample``).

A control that reads its own field lives in worker/logits_processors.py: this class feeds every processor the
records of the sequences that start (``start``), the slots that leave (``free``) and the step's sampled rows
(``tensors``), so a new sampling field applied there needs no line here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from comm.parallel import tp_rank
from protocol.sampling_params import SamplingParams
from worker.logits_processors import PROCESSORS
from worker.sampler import SamplingTensors, uses_fused_kernel

_MAX_TOP_K = 2**31 - 1  # any k >= the vocabulary keeps every token

ToDevice = Callable[..., torch.Tensor]  # (numpy array, torch dtype = int64) -> device tensor


class SamplingState:
    def __init__(
        self,
        max_num_seqs: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
        to_dev: ToDevice,
    ) -> None:
        n = max_num_seqs
        self.vocab_size, self.device, self.to_dev = vocab_size, device, to_dev
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_cuda = device.type == "cuda"  # decides whether the fused kernel (temperature only) samples
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_p = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.seed = np.full(n, -1, dtype=np.int64)
        # optional controls (defaults = off); any_controls says whether some slot uses one
        self.min_tokens_left = np.zeros(n, dtype=np.int64)  # samples still to take with stop_ids masked
        self.stop_ids = np.full((n, 0), -1, dtype=np.int64)  # [n, widest list] ids masked before min_tokens
        self.presence_penalty = np.zeros(n, dtype=np.float32)
        self.frequency_penalty = np.zeros(n, dtype=np.float32)
        self.repetition_penalty = np.ones(n, dtype=np.float32)
        self.has_penalty = np.zeros(n, dtype=bool)
        self.num_logprobs = np.full(n, -1, dtype=np.int64)  # top-N logprobs per sampled token; -1 = none
        self.has_bias = np.zeros(n, dtype=bool)
        self.bias_slots = np.zeros(0, dtype=np.int64)  # the sparse logit-bias table, one entry per (slot, token)
        self.bias_tokens = np.zeros(0, dtype=np.int64)
        self.bias_values = np.zeros(0, dtype=np.float32)
        self.processors = [cls(n, vocab_size, device, to_dev) for cls in PROCESSORS]
        self.any_controls = False
        # rank 0, allocated when a penalized sequence first arrives
        self.output_counts: torch.Tensor | None = None  # [max_num_seqs, vocab] int32
        self.prompt_mask: torch.Tensor | None = None  # [max_num_seqs, vocab] bool

    # ---- sequences entering and leaving slots -----------------------------------------------------------

    def start(
        self,
        slots: np.ndarray,
        params: list[SamplingParams],
        num_outputs: np.ndarray,
        prompt_lens: np.ndarray,
        past_token_ids: np.ndarray,
    ) -> None:
        """Sequences starting in ``slots``: their records, the outputs they already have (after a preemption) and
        their past tokens (per sequence ``prompt_lens[i]`` prompt ids, then its ``num_outputs[i]`` outputs)."""
        slots = slots.astype(np.int64)
        for proc in self.processors:
            proc.start(slots, params)
        self.temperature[slots] = [p.temperature for p in params]
        self.top_p[slots] = [p.top_p for p in params]
        self.top_k[slots] = [min(p.top_k, _MAX_TOP_K) for p in params]
        self.min_p[slots] = [p.min_p for p in params]
        # -1 marks unseeded rows: a request's int64 seed (vLLM takes negative ones) maps onto [0, 2**63)
        self.seed[slots] = [-1 if p.seed is None else p.seed % 2**63 for p in params]
        left = np.maximum(np.fromiter((p.min_tokens for p in params), np.int64, len(params)) - num_outputs, 0)
        pres = np.fromiter((p.presence_penalty for p in params), np.float32, len(params))
        freq = np.fromiter((p.frequency_penalty for p in params), np.float32, len(params))
        rep = np.fromiter((p.repetition_penalty for p in params), np.float32, len(params))
        logprobs = np.fromiter((-1 if p.logprobs is None else p.logprobs for p in params), np.int64, len(params))
        penalized = (pres != 0) | (freq != 0) | (rep != 1)
        biased = np.fromiter((p.logit_bias is not None for p in params), bool, len(params))
        masked = {int(i): self._masked_ids(params[i]) for i in np.flatnonzero(left)}
        left[[i for i, ids in masked.items() if not ids]] = 0  # nothing to mask: min_tokens changes nothing
        if not (left.any() or penalized.any() or (logprobs >= 0).any() or biased.any()):
            # a slot's previous sequence may have used them; or a processor's use starts
            if self.any_controls or any(proc.active for proc in self.processors):
                self._reset_controls(slots)
            return
        self.min_tokens_left[slots] = left
        self._set_stop_ids(slots, masked)
        self.presence_penalty[slots], self.frequency_penalty[slots], self.repetition_penalty[slots] = pres, freq, rep
        self.has_penalty[slots] = penalized
        self.num_logprobs[slots] = logprobs
        self._set_bias(slots, [params[i].logit_bias for i in np.flatnonzero(biased)], biased)
        if penalized.any() and tp_rank() == 0:
            self._start_penalty_state(slots, penalized, num_outputs, prompt_lens, past_token_ids)
        self._refresh_any_controls()

    def free(self, slots: np.ndarray) -> None:
        for proc in self.processors:
            proc.free(slots)
        if self.any_controls:
            self._reset_controls(slots)

    def _masked_ids(self, p: SamplingParams) -> list[int]:
        """Ids a sequence may not sample while its min_tokens are pending: its stop ids and (unless ignore_eos)
        the EOS ids."""
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))

    def _set_stop_ids(self, slots: np.ndarray, masked: dict[int, list[int]]) -> None:
        self.stop_ids[slots] = -1
        counts = np.zeros(len(slots), dtype=np.int64)
        counts[list(masked)] = [len(ids) for ids in masked.values()]
        total = int(counts.sum())
        if not total:
            return
        width = int(counts.max())
        if width > self.stop_ids.shape[1]:
            grown = np.full((len(self.stop_ids), width), -1, dtype=np.int64)
            grown[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = grown
        rows = np.repeat(slots, counts)
        cols = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        self.stop_ids[rows, cols] = [t for i in sorted(masked) for t in masked[i]]

    def _set_bias(self, slots: np.ndarray, biases: list[dict[int, float]], biased: np.ndarray) -> None:
        """Replace the table entries of ``slots`` with the ``biases`` of its ``biased`` ones (in order)."""
        if self.has_bias[slots].any():  # a previous sequence of one of these slots had a bias
            keep = ~np.isin(self.bias_slots, slots)
            self.bias_slots, self.bias_tokens = self.bias_slots[keep], self.bias_tokens[keep]
            self.bias_values = self.bias_values[keep]
        self.has_bias[slots] = biased
        if not biases:
            return
        counts = [len(b) for b in biases]
        self.bias_slots = np.concatenate([self.bias_slots, np.repeat(slots[biased], counts)])
        tokens = np.fromiter((t for b in biases for t in b), np.int64, sum(counts))
        values = np.fromiter((v for b in biases for v in b.values()), np.float32, sum(counts))
        self.bias_tokens = np.concatenate([self.bias_tokens, tokens])
        self.bias_values = np.concatenate([self.bias_values, values])

    def _reset_controls(self, slots: np.ndarray) -> None:
        self.min_tokens_left[slots] = 0
        self.has_penalty[slots] = False
        self.num_logprobs[slots] = -1
        self._set_bias(slots, [], np.zeros(len(slots), dtype=bool))
        self._refresh_any_controls()

    def _refresh_any_controls(self) -> None:
        self.any_controls = bool(
            self.min_tokens_left.any()
            or self.has_penalty.any()
            or (self.num_logprobs >= 0).any()
            or len(self.bias_slots)
            or any(proc.active for proc in self.processors)
        )

    def _start_penalty_state(
        self,
        slots: np.ndarray,
        penalized: np.ndarray,
        num_outputs: np.ndarray,
        prompt_lens: np.ndarray,
        past_token_ids: np.ndarray,
    ) -> None:
        """Reset the penalized slots' device state and fill it from the tokens they already have: the prompt
        (repetition penalty; prefix-cache hits are never computed here, so the coordinator sends it) and, after
        a preemption, the outputs so far."""
        if self.output_counts is None:
            shape = (len(self.temperature), self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        dev_slots = self.to_dev(slots[penalized])
        self.output_counts[dev_slots] = 0
        self.prompt_mask[dev_slots] = False
        lens = prompt_lens.astype(np.int64) + num_outputs
        total = int(lens.sum())
        if not total:
            return
        owner = np.repeat(np.arange(len(slots)), lens)
        offset = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        counted = penalized[owner]  # an unpenalized sequence's past tokens (a preemption's outputs) count nowhere
        in_prompt = counted & (offset < prompt_lens[owner])
        in_output = counted & ~in_prompt
        tok_slots = slots[owner]
        if in_prompt.any():
            self.prompt_mask[self.to_dev(tok_slots[in_prompt]), self.to_dev(past_token_ids[in_prompt])] = True
        if in_output.any():
            ones = torch.ones(int(in_output.sum()), dtype=torch.int32, device=self.device)
            index = (self.to_dev(tok_slots[in_output]), self.to_dev(past_token_ids[in_output]))
            self.output_counts.index_put_(index, ones, accumulate=True)

    # ---- one step -----------------------------------------------------------------------------------------

    def tensors(self, sample_slots: np.ndarray, sample_positions: np.ndarray) -> SamplingTensors:
        """The sampled rows' controls on the device, and the host-side facts that let the sampler skip work."""
        t, k, p = self.temperature[sample_slots], self.top_k[sample_slots], self.top_p[sample_slots]
        mp, sd = self.min_p[sample_slots], self.seed[sample_slots]
        all_greedy = bool((t == 0).all())
        flags = bool((k > 0).any()), bool((p < 1).any()), bool((mp > 0).any()), bool((sd >= 0).any())
        # copy only the controls the chosen path reads: none for an all-greedy argmax, the temperature alone for
        # the fused CUDA kernel (W1's case: one copy per step instead of six)
        fused = uses_fused_kernel(self.on_cuda, *flags)
        copy = (lambda arr, dtype=torch.int64: None) if all_greedy or fused else self.to_dev
        st = SamplingTensors(
            temperature=None if all_greedy else self.to_dev(t, torch.float32),
            top_k=copy(k),
            top_p=copy(p, torch.float32),
            min_p=copy(mp, torch.float32),
            seed=copy(sd),
            position=copy(sample_positions),
            all_greedy=all_greedy,
            any_top_k=flags[0],
            any_top_p=flags[1],
            any_min_p=flags[2],
            any_seed=flags[3],
        )
        if self.any_controls:
            self._add_controls(st, sample_slots)
        return st

    def _add_controls(self, st: SamplingTensors, sample_slots: np.ndarray) -> None:
        """Logit biases, min_tokens bans and penalties of this step's sampled rows (rank 0; only when some slot
        uses them)."""
        if len(self.bias_slots) and self.has_bias[sample_slots].any():
            # each table entry's row in this step (-1: its slot is not sampled now)
            row_of = np.full(len(self.has_bias), -1, dtype=np.int64)
            row_of[sample_slots] = np.arange(len(sample_slots))
            rows = row_of[self.bias_slots]
            hit = rows >= 0
            tokens, values = self.bias_tokens[hit], self.bias_values[hit]
            st.logit_bias = (self.to_dev(rows[hit]), self.to_dev(tokens), self.to_dev(values, torch.float32))
        rows = np.flatnonzero(self.min_tokens_left[sample_slots] > 0)
        if len(rows):
            ids = self.stop_ids[sample_slots[rows]]
            r, c = np.nonzero(ids >= 0)
            st.banned = (self.to_dev(rows[r]), self.to_dev(ids[r, c]))
        rows = np.flatnonzero(self.has_penalty[sample_slots])
        if len(rows):
            slots = sample_slots[rows]
            slots_dev = self.to_dev(slots)
            st.penalty_rows = self.to_dev(rows)
            st.presence_penalty = self.to_dev(self.presence_penalty[slots], torch.float32)
            st.frequency_penalty = self.to_dev(self.frequency_penalty[slots], torch.float32)
            st.repetition_penalty = self.to_dev(self.repetition_penalty[slots], torch.float32)
            st.output_counts = self.output_counts[slots_dev]
            st.prompt_mask = self.prompt_mask[slots_dev]
        used = [(proc, proc.prepare(sample_slots)) for proc in self.processors if proc.active]
        st.processed = tuple((proc, data) for proc, data in used if data is not None) or None

    def after_sample(
        self, st: SamplingTensors, sample_slots: np.ndarray, slots_dev: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Count the sampled tokens into the penalized slots' outputs (on the device) and advance min_tokens."""
        if st.penalty_rows is not None:
            rows = st.penalty_rows
            index = (slots_dev[rows], tokens[rows])
            ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, ones, accumulate=True)
        if st.banned is not None:
            slots = sample_slots[self.min_tokens_left[sample_slots] > 0]
            self.min_tokens_left[slots] -= 1
            if not self.min_tokens_left[slots].any():
                self._refresh_any_controls()

    def after_verify(self, position_slots: np.ndarray, tokens: torch.Tensor, kept: torch.Tensor) -> None:
        """Verify rows (rank 0): count the emitted tokens (``kept`` of the positions, one slot each) into the
        penalized slots' outputs. The coordinator drafts only for sequences without penalties; this keeps the
        counts right should one have them."""
        penalized = self.has_penalty[position_slots]
        if not penalized.any():
            return
        rows = self.to_dev(np.flatnonzero(penalized))
        index = (self.to_dev(position_slots[penalized]), tokens[rows])
        self.output_counts.index_put_(index, kept[rows].to(torch.int32), accumulate=True)

    def advance_min_tokens(self, slots: np.ndarray, emitted: np.ndarray) -> None:
        """Verify rows (rank 0): each slot emitted ``emitted`` tokens towards its min_tokens."""
        left = self.min_tokens_left[slots]
        if left.any():
            self.min_tokens_left[slots] = np.maximum(left - emitted, 0)
            self._refresh_any_controls()
