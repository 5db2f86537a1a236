"""The inputs the attention benchmarks share (benchmarks/attention_kernels.py, benchmarks/attention_sweeps.py): a
paged KV pool of Qwen3-8B-like heads, the decode and prefill metadata over it, the torch reference and the Triton
backend under test, and a median timing."""

from __future__ import annotations

import math

import torch
import triton
import triton.testing

from kernels.attention import AttentionMetadata, TorchAttentionBackend
from kernels.triton_attention import TritonAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 3e-3}

REF = TorchAttentionBackend()
TRI = TritonAttentionBackend()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def median_ms(fn, rep: int = 200) -> float:
    # quantiles (not return_mode) works on every Triton 3.x
    return triton.testing.do_bench(fn, warmup=25, rep=rep, quantiles=[0.5, 0.2, 0.8])[0]


def make_pool(
    lengths: list[int],
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    kv_heads: int = NUM_KV_HEADS,
    layout: str = "nhd",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random pool with each sequence on shuffled blocks; returns (k_cache, v_cache, block_table int32).
    ``layout`` "nhd": a block is [tokens, kv heads, head_dim] in memory (the engine's); "hnd": [kv heads, tokens,
    head_dim], each head's slice of a block contiguous, returned as a strided view of the same logical shape."""
    need = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(need) + 1
    hnd = layout == "hnd"
    shape = (num_blocks, kv_heads, block_size, HEAD_DIM) if hnd else (num_blocks, block_size, kv_heads, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, dtype=dtype, device="cuda", generator=gen) for _ in range(2))
    if hnd:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32, device="cuda")
    off = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[off : off + nb]
        off += nb
    return k_cache, v_cache, table


def decode_meta(lens: torch.Tensor, table: torch.Tensor, max_len: int) -> AttentionMetadata:
    batch = len(lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        num_prefill_tokens=0,
        num_prefills=0,
        num_decodes=batch,
        decode_seq_lens=lens.to(torch.int32),
        decode_block_tables=table,
        max_decode_seq_len=max_len,
    )


def prefill_meta(q_lens: list[int], kv_lens: list[int], table: torch.Tensor) -> AttentionMetadata:
    """Metadata of a prefill-only step: sequence i has q_lens[i] new tokens after kv_lens[i] - q_lens[i] cached."""
    num_tokens = sum(q_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device="cuda"),
        num_prefill_tokens=num_tokens,
        num_prefills=len(q_lens),
        num_decodes=0,
        cu_seqlens_q=torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32),
        prefill_seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device="cuda"),
        prefill_block_tables=table,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(kv_lens),
    )
