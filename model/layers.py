"""Embedding, LM head, RMSNorm, activation and paged attention: the layers every family shares (linear layers live in
model/linear.py, rotary embeddings in model/rotary.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from comm.parallel import all_reduce, all_reduce_add_rmsnorm, gather_to_rank0, tp_rank, tp_size
from kernels import fused
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.decode_gemm import decode_linear, decode_linear_tiles
from kernels.qk_norm_rope import KVStore, qk_norm_rope_
from model.context import get_context
from model.linear import check_shape
from model.rotary import RotaryEmbedding, qk_norm_rope


class VocabParallelEmbedding(nn.Module):
    """Vocabulary split across ranks (padded to a multiple of tp); masked lookup, then all-reduce."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        check_shape(torch.empty(self.vocab_size, param.shape[1], device="meta"), loaded)
        rows = loaded[self.start : self.start + self.shard_size]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits sharded by vocabulary; gathered on rank 0 only, or left on each rank (``shard``)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = gather_to_rank0(_logits(hidden, self.weight))
        return None if logits is None else logits[:, : self.vocab_size]

    def shard(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's logits (its shard's real token ids, without the padding) and the first one's token id."""
        valid = max(0, min(self.shard_size, self.vocab_size - self.start))
        return _logits(hidden, self.weight[:valid]), self.start


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # one or two decode rows take our GEMV (8B head, one row: 274 us against cuBLAS's 292; W2 FP8 -5%)
    tiles = decode_linear_tiles(hidden, weight)
    return F.linear(hidden, weight) if tiles is None else decode_linear(hidden, weight, tiles)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF does); with ``residual`` it first adds it and returns the sum too."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda and x.dim() == 2:
            return fused.rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_partial(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``forward`` of ``x`` summed over the tensor-parallel ranks (``x``: this rank's partial output of a
        row-parallel layer). On GPUs with a symmetric buffer the all-reduce, add and norm are one kernel."""
        fused_out = all_reduce_add_rmsnorm(x, residual, self.weight, self.eps)
        if fused_out is not None:
            return fused_out
        return self.forward(all_reduce(x), residual)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class PagedAttention(nn.Module):
    """Writes this step's K/V into the pool and attends over it, using the context the runner set."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])  # bound to the pool by the runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        ctx.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.meta.slot_mapping)
        return self._attend(q, ctx.meta, ctx.backend)

    def forward_qk_norm_rope(
        self,
        positions: torch.Tensor,
        qk: torch.Tensor,
        v: torch.Tensor,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        rope: RotaryEmbedding,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``forward`` for raw q/k projections ([tokens, q heads + k heads, head_dim], see ``qk_norm_rope``; norms
        None: RoPE only): on CUDA the per-head norms, RoPE and the KV store are one kernel, one launch fewer per
        layer. ``scales`` (CUDA): q/k and v are an FP8 product before its scales, which that kernel applies."""
        if not qk.is_cuda:
            assert scales is None, "unscaled FP8 products are a CUDA path"
            return self.forward(*qk_norm_rope(positions, qk, self.num_heads, q_norm, k_norm, rope), v)
        ctx = get_context()
        store = KVStore(v, self.k_cache, self.v_cache, ctx.meta.slot_mapping)
        wq, wk, eps = (None, None, 0.0) if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        qk_norm_rope_(qk, wq, wk, eps, rope.cos_sin, positions, self.num_heads, store, scales)
        return self._attend(qk[:, : self.num_heads], ctx.meta, ctx.backend)

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        n_pre = meta.num_prefill_tokens
        if meta.num_decodes == 0:
            return backend.prefill(q, self.k_cache, self.v_cache, meta, self.scale)
        if n_pre == 0:
            return backend.decode(q, self.k_cache, self.v_cache, meta, self.scale)
        out = torch.empty_like(q)
        out[:n_pre] = backend.prefill(q[:n_pre], self.k_cache, self.v_cache, meta, self.scale)
        out[n_pre:] = backend.decode(q[n_pre:], self.k_cache, self.v_cache, meta, self.scale)
        return out
