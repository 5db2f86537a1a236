"""Attention over a paged KV cache: the backend interface, the per-step metadata and the torch reference.
kernels/backends.py picks a backend; the Triton and flash-attn backends build on this module, never the reverse.

KV cache layout, per layer: ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`` (an e4m3
V cache is that shape as a view of pages stored keys-contiguous, ``value_cache``).
Token ``i`` of a sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``;
``slot_mapping`` holds that slot for every token computed in a step (-1 = padding, not written).

A step's tokens are laid out prefill-first: ``num_prefill_tokens`` tokens of ``num_prefills`` sequences
(each a chunk continuing from a cached prefix, possibly empty), then one token per decode sequence.
New K/V are written to the cache before attention, so both paths read keys from the cache only.

The cache is in the model's dtype, or e4m3 (``kv_cache_dtype="fp8"``: twice the tokens of a 16-bit cache), which
stores ``value / scale`` saturated at 448, with one float scale for K and one for V per layer (the backends'
``k_scale`` / ``v_scale``, 1.0 unless given: the model passes none, as vLLM runs FP8 caches without calibrated
scales). Attention reads e4m3 values times their scale; a 16-bit cache ignores the scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built by the worker's runner, read by the layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = skip
    num_prefill_tokens: int
    num_prefills: int
    num_decodes: int
    # prefill part (sequences 0 .. num_prefills-1)
    cu_seqlens_q: torch.Tensor | None = None  # [num_prefills + 1] int32, offsets into the prefill tokens
    prefill_seq_lens: torch.Tensor | None = None  # [num_prefills] int32, context length incl. new tokens
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # decode part (one query token per sequence)
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int32
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    max_decode_seq_len: int = 0


class AttentionBackend:
    """Interface: a backend writes K/V into the pool and computes paged attention for both phases."""

    name = "abstract"

    def store_kvcache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        raise NotImplementedError

    def prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [num_prefill_tokens, num_heads, head_dim] -> same shape. Causal over cached prefix + chunk.
        Backends that read e4m3 caches also take ``k_scale`` and ``v_scale`` keywords."""
        raise NotImplementedError

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [num_decodes, num_heads, head_dim] -> same shape. One query at position seq_len - 1."""
        raise NotImplementedError


FP8_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def cache_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The K and V scales attention applies to ``cache``: its own when e4m3, 1.0 for a 16-bit cache."""
    return (k_scale, v_scale) if is_fp8(cache) else (1.0, 1.0)


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as ``cache`` stores it."""
    if is_fp8(cache):
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
    return x.to(cache.dtype)


def value_cache(v: torch.Tensor) -> torch.Tensor:
    """The V cache attention reads from the contiguous [blocks, page, kv heads, head_dim] memory ``v``: as is when
    16-bit; e4m3 stores each page as [kv heads, head_dim, page] instead (keys contiguous), returned as a view of the
    usual shape. The P.V dot wants each value's keys side by side, which an 8-bit [keys, head_dim] tile holds only
    after byte-wise transposes (40% of the decode kernel's instructions; 250 registers a thread instead of 128)."""
    if not is_fp8(v):
        return v
    blocks, page, heads, dim = v.shape
    return v.as_strided(v.shape, (heads * dim * page, 1, dim * page, page), v.storage_offset())


def copy_to_value_cache(v: torch.Tensor) -> torch.Tensor:
    """A copy of the [blocks, page, kv heads, head_dim] values ``v`` in ``value_cache``'s layout (tests, benchmarks)."""
    return value_cache(torch.empty(v.shape, dtype=v.dtype, device=v.device)).copy_(v)


def keys_contiguous(v_cache: torch.Tensor) -> bool:
    """Whether ``v_cache`` is ``value_cache``'s keys-contiguous layout."""
    page = v_cache.shape[1]
    return page > 1 and v_cache.stride(1) == 1 and v_cache.stride(3) == page


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from the pool: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


class TorchAttentionBackend(AttentionBackend):
    """Pure-torch reference: runs anywhere, favours clarity; the oracle for the Triton kernels."""

    name = "torch"

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        block, in_page = slots // k_cache.shape[1], slots % k_cache.shape[1]  # any layout, value_cache's too
        k_cache[block, in_page] = to_cache(k[keep], k_cache, k_scale)
        v_cache[block, in_page] = to_cache(v[keep], v_cache, v_scale)

    def prefill(self, q, k_cache, v_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        k_scale, v_scale = cache_scales(k_cache, k_scale, v_scale)
        out = torch.empty_like(q)
        cu = meta.cu_seqlens_q.tolist()
        seq_lens = meta.prefill_seq_lens.tolist()
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        for i in range(meta.num_prefills):
            qs = q[cu[i] : cu[i + 1]]
            q_len, kv_len = qs.shape[0], seq_lens[i]
            k = gather_paged(k_cache, meta.prefill_block_tables[i], kv_len)
            v = gather_paged(v_cache, meta.prefill_block_tables[i], kv_len)
            k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
            v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
            # query j sits at position kv_len - q_len + j and sees keys 0..that position
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            scores = torch.einsum("qhd,khd->hqk", qs.float(), k.float() * k_scale) * scale
            scores = scores.masked_fill(~mask[None], -math.inf)
            out[cu[i] : cu[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float() * v_scale).to(q.dtype)
        return out

    def decode(self, q, k_cache, v_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        # Vectorized over the batch: gather every sequence's blocks, mask past its length.
        k_scale, v_scale = cache_scales(k_cache, k_scale, v_scale)
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        tables = meta.decode_block_tables.long()
        k = k_cache[tables].flatten(1, 2)  # [B, max_blocks*block_size, kvh, d]
        v = v_cache[tables].flatten(1, 2)
        group = num_heads // num_kv_heads
        qg = q.float().view(num_decodes, num_kv_heads, group, head_dim)
        scores = torch.einsum("bhgd,bkhd->bhgk", qg, k.float() * k_scale) * scale
        key_pos = torch.arange(k.shape[1], device=q.device)
        valid = key_pos[None, :] < meta.decode_seq_lens.long()[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
        out = torch.einsum("bhgk,bkhd->bhgd", scores.softmax(-1), v.float() * v_scale)
        return out.reshape(num_decodes, num_heads, head_dim).to(q.dtype)
