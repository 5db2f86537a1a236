"""Sampling in one read of the logits: greedy argmax, or temperature sampling by the Gumbel-max trick.

``argmax(logits / T + G)`` with ``G = -log(-log(U))`` draws from ``softmax(logits / T)`` exactly (the same law as
the torch sampler's ``argmax(probs / E)``), so no softmax, probability tensor or float32 copy of the logits is
materialized: at batch 256 and a 152k vocabulary the torch chain makes ~7 passes over a 155 MB float32 tensor
(~0.5 ms per step on an H200), this kernel one pass over the 78 MB bf16 logits. Rows with temperature 0 take
the plain argmax (ties: lowest index, as torch). Masks (-inf logits) never win.

Two launches: each program takes the best (value, index) of one vocabulary chunk of one row, so a batch of one
still spreads over the GPU; a second pass picks each row's best chunk. Noise comes from Philox keyed by a
per-step seed chosen on the host, so nothing here reads device values on the host.

Under tensor parallelism each rank holds a vocabulary shard of the logits. ``shard_best`` keys the noise by the
global token id, so the best (score, id) over the whole vocabulary is the best of the shards' bests: the ranks
exchange one pair per row instead of gathering the logits (worker/sampler.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import num_sms
from kernels.pdl import pdl_enter, use_pdl

_BLOCK = 1024
_MAX_CHUNKS = 64  # also the second pass's fixed width: one compiled variant whatever the batch size


@triton.jit(do_not_specialize=["stride", "vocab", "seed", "chunk", "num_chunks", "col_offset", "counter_vocab"])
def _chunk_best_kernel(
    logits_ptr,
    temp_ptr,
    val_ptr,
    idx_ptr,
    stride,
    vocab,
    seed,
    chunk,
    num_chunks,
    col_offset,  # global token id of column 0 (a vocabulary shard's start)
    counter_vocab,  # the whole vocabulary's size: noise counters are (row, global token id)
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    if SAMPLE:
        t = tl.load(temp_ptr + row)
        inv_t = 1.0 / tl.maximum(t, 1e-6)
        noisy = t > 0.0
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    offs = tl.arange(0, BLOCK)
    for lo in range(start, end, BLOCK):
        cols = lo + offs
        mask = cols < end
        x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if SAMPLE:
            # the counter is (row, token id): distinct for every draw of a step; the seed changes per step
            u = tl.rand(seed, (row * counter_vocab + col_offset + cols).to(tl.int32))
            gumbel = -tl.log(-tl.log(u))  # u = 0 gives -inf: that token cannot win
            x = tl.where(noisy, x * inv_t + gumbel, x)
            x = tl.where(mask, x, float("-inf"))
        v = tl.max(x, 0)
        i = tl.argmax(x, 0).to(tl.int32)  # leftmost on ties
        better = v > best_v  # strictly: an earlier block keeps ties
        best_i = tl.where(better, lo + i, best_i)
        best_v = tl.where(better, v, best_v)
    tl.store(val_ptr + row * num_chunks + c, best_v)
    tl.store(idx_ptr + row * num_chunks + c, best_i + col_offset)


@triton.jit(do_not_specialize=["num_chunks"])
def _row_best_kernel(val_ptr, idx_ptr, out_ptr, out_val_ptr, num_chunks, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    v = tl.load(val_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    best = tl.argmax(v, 0)  # leftmost chunk on ties, so the lowest token id overall
    idx = tl.load(idx_ptr + row * num_chunks + best)
    tl.store(out_ptr + row, idx.to(tl.int64))
    tl.store(out_val_ptr + row, tl.max(v, 0))


def sample_argmax(logits: torch.Tensor, temperature: torch.Tensor | None, seed: int) -> torch.Tensor:
    """One token id per row (int64 [n]) of ``logits`` [n, vocab] (any float dtype; rows may be strided).

    ``temperature`` None: greedy for every row; else float32 [n], 0 = greedy for that row. ``seed`` (0 <= seed
    < 2**31) keys the noise: pass a new one per step.
    """
    return shard_best(logits, temperature, seed)[1]


def shard_best(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    seed: int,
    col_offset: int = 0,
    counter_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_argmax`` over a vocabulary shard: per row, the best score (float32 [n]: the logit, or logit / T
    plus Gumbel noise) and its global token id (int64 [n]). ``logits`` holds the shard's valid columns, which are
    token ids ``col_offset ..``; ``counter_vocab`` is the whole vocabulary's size (default: the shard's)."""
    n, vocab = logits.shape
    counter_vocab = vocab if counter_vocab is None else counter_vocab
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    out_val = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out_val, out
    assert logits.stride(-1) == 1, "rows must be contiguous"
    max_chunks = triton.cdiv(vocab, 4 * _BLOCK)  # >= 4 blocks of work per program
    num_chunks = max(1, min(max_chunks, triton.cdiv(4 * num_sms(logits.device, cpu=2), n), _MAX_CHUNKS))
    chunk = triton.cdiv(triton.cdiv(vocab, num_chunks), _BLOCK) * _BLOCK
    num_chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty((n, num_chunks), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((n, num_chunks), dtype=torch.int32, device=logits.device)
    sample = temperature is not None
    pdl = use_pdl(logits)
    _chunk_best_kernel[(n, num_chunks)](
        logits,
        temperature if sample else vals,
        vals,
        idxs,
        logits.stride(0),
        vocab,
        seed,
        chunk,
        num_chunks,
        col_offset,
        counter_vocab,
        SAMPLE=sample,
        BLOCK=_BLOCK,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    _row_best_kernel[(n,)](
        vals, idxs, out, out_val, num_chunks, BLOCK_C=_MAX_CHUNKS, USE_PDL=pdl, num_warps=1, launch_pdl=pdl
    )
    return out_val, out


def warmup(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the greedy and the sampling variant at start-up (a first compile mid-run costs ~70 ms a step)."""
    logits = torch.zeros((2, vocab), dtype=dtype, device=device)
    sample_argmax(logits, None, 0)
    sample_argmax(logits, torch.ones(2, device=device), 0)
