"""CUDA graphs for steps with prefill tokens: one whole forward per token-count bucket, attention included.

A step's attention depends on its layout (how many sequences, how long each chunk, which are decode rows), which
an eager launch sizes its grid by. Here every layer's attention is one whole-step launch (kernels/attention_flat.py)
of a fixed number of persistent programs that read the layout from static buffers, so the whole forward replays
as one graph: launching an 8B model's mixed step went from ~3 host launches a layer (12.3 ms, host-bound) to one
replay. A step's tokens are padded up to its bucket: padding rows write no KV (slot -1) and belong to no sequence,
so attention neither reads nor writes them (their output rows hold earlier steps' values, finite).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import nn

from kernels.attention import AttentionMetadata
from kernels.attention_flat import whole_step_attention, work_layout
from kernels.device import num_sms
from model.context import forward_context
from worker.cuda_graphs import StaticTokens
from worker.transfer import HostStager

PROGRAMS_PER_SM = 2  # the whole-step kernel's 64 x 64 tiles fit two programs an SM (tests/support/attention_sm90_build)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts the graphs are captured for. A step runs padded to the next one, and a mixed step's GEMMs are
    compute-bound at 8B: a 278-token step (a 256-token chunk beside 22 decode rows) padded to 512 cost ~70% more
    tensor-core work than it needed. So: by 64 to 256, by 32 to 384 (where mixed steps under load fall: the prefill
    cap plus the decode rows), then 512 and 768, then every 1024 up to ``max_tokens``; 16-128 keep a short prompt's
    first token cheap."""
    sizes = [t for t in (16, 32, 64, 128, 192, 256, 288, 320, 352, 384, 512, 768) if t < max_tokens]
    sizes += list(range(1024, max_tokens, 1024)) + [max_tokens]
    return sorted(set(sizes))


class WholeStepInputs(StaticTokens):
    """The static buffers a whole-step forward reads (token ids, positions, slot mapping; the attention layout and
    block tables) and the attention backend that reads them; ``load`` fills them for one step."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``max_seqs``: the most attention sequences (prefill chunks and decode rows) a step brings."""
        self.max_tokens, self.max_seqs = max_tokens, min(max_seqs, max_tokens)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        super().__init__(max_tokens, device)
        # one int32 buffer, one copy a step: (work items, sequences), cu [max_seqs + 1], seq_lens [max_seqs]
        self.layout = torch.zeros(3 + 2 * self.max_seqs, dtype=torch.int32, device=device)
        self.work, self.cu = self.layout[:2], self.layout[2 : 3 + self.max_seqs]
        self.seq_lens = self.layout[3 + self.max_seqs :]
        self.tables = torch.zeros(self.max_seqs, max_blocks, dtype=torch.int32, device=device)
        # zeros, so padding rows start finite; afterwards they hold earlier steps' values
        self.out_buf = torch.zeros(max_tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.num_programs = PROGRAMS_PER_SM * num_sms(device, cpu=4)

    def holds(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs

    def meta(self, tokens: int) -> AttentionMetadata:
        """The metadata a forward of ``tokens`` rows runs under: its slot mapping; every row a "prefill" row, so each
        layer calls the backend's ``prefill`` once."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], num_prefill_tokens=tokens, num_prefills=1, num_decodes=0
        )

    def attention(self, store_kvcache) -> _WholeStepAttention:
        return _WholeStepAttention(self, store_kvcache)

    def load(
        self,
        stager: HostStager,
        input_ids: torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        q_lens: np.ndarray,
        seq_lens: np.ndarray,
        tables: np.ndarray,
        tokens: int,
    ) -> None:
        """A step of ``len(input_ids)`` tokens, padded to ``tokens``. Its attention sequences (prefill chunks, then
        decode rows of one query each) take ``q_lens`` queries each, have ``seq_lens`` tokens of context after the
        step, and ``tables`` rows."""
        num_seqs = len(q_lens)
        cu, items = work_layout(q_lens, self.num_heads, self.num_kv_heads)
        layout = np.zeros(len(self.layout), dtype=np.int32)
        layout[:2] = items, num_seqs
        layout[2 : 3 + num_seqs] = cu
        layout[3 + self.max_seqs : 3 + self.max_seqs + num_seqs] = seq_lens
        self.layout.copy_(stager.to_device(layout, torch.int32))
        self.tables[:num_seqs, : tables.shape[1]].copy_(stager.to_device(tables, torch.int32))
        self.load_tokens(stager, input_ids, positions, slot_mapping, tokens)


class _WholeStepAttention:
    """The attention backend a whole-step forward sees: each layer's attention is one whole-step launch over the
    static layout, into the static output buffer."""

    def __init__(self, inputs: WholeStepInputs, store_kvcache) -> None:
        self.inputs, self.store_kvcache = inputs, store_kvcache

    def prefill(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        i = self.inputs
        out = i.out_buf[: q.shape[0]]
        return whole_step_attention(
            q, k_cache, v_cache, i.cu, i.seq_lens, i.tables, i.work, scale, out, i.max_seqs, i.num_programs
        )


class PrefillGraphs:
    """Whole-forward CUDA graphs for steps with prefill tokens (see the module docstring), reading ``inputs``."""

    def __init__(self, model: nn.Module, inputs: WholeStepInputs, store_kvcache) -> None:
        """``store_kvcache``: the attention backend's KV store."""
        self.inputs = inputs
        self.buckets = token_buckets(inputs.max_tokens)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        attention, device, pool = inputs.attention(store_kvcache), inputs.input_ids.device, None
        for tokens in reversed(self.buckets):  # largest first: the smaller ones reuse its pool memory
            ids, pos = inputs.input_ids[:tokens], inputs.positions[:tokens]
            with forward_context(inputs.meta(tokens), attention):
                model(ids, pos)  # compiles every kernel for this token count outside the capture (no work: no rows)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[tokens] = model(ids, pos)
            pool = graph.pool()
            self.graphs[tokens] = graph
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the eager passes' blocks: steps up to max_tokens run here, not eagerly

    def holds(self, num_tokens: int, num_seqs: int) -> bool:
        return self.inputs.holds(num_tokens, num_seqs)

    def run(
        self,
        stager: HostStager,
        input_ids: torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        *rows: np.ndarray,
    ) -> torch.Tensor:
        """The step's hidden states; ``rows``: its attention sequences' (q_lens, seq_lens, tables), as
        ``WholeStepInputs.load`` takes them."""
        n = len(input_ids)
        tokens = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.inputs.load(stager, input_ids, positions, slot_mapping, *rows, tokens)
        self.graphs[tokens].replay()
        return self.outputs[tokens][:n]
