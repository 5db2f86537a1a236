"""Tensor-parallel-ready layers. Each parameter carries a ``weight_loader`` that takes the full checkpoint
tensor and copies this rank's shard into place, so loading needs no knowledge of the sharding scheme."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cublaslt, fused
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.decode_gemm import decode_linear, decode_linear_tiles
from model.context import get_context
from model.parallel import all_reduce, all_reduce_add_rmsnorm, gather_to_rank0, partial_sum_buffer, tp_rank, tp_size


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch{what}: checkpoint has {tuple(loaded.shape)}, model expects {tuple(param.shape)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    _check_shape(param, loaded)
    param.data.copy_(loaded)


def _shard_rows(loaded: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    if loaded.shape[dim] % size:
        raise ValueError(f"shape mismatch: dimension {dim} of {tuple(loaded.shape)} does not split into {size} {name}")
    return loaded.chunk(size, dim)[rank]


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, into ``out`` when given (a contiguous [rows, out_features] tensor)."""
        if self.bias is None:
            tiles = decode_linear_tiles(x, self.weight)
            if tiles is not None:
                return decode_linear(x, self.weight, tiles, out)
            algo = cublaslt.chosen_algo(x, self.weight) if x.is_cuda else None
            if algo is not None and (out is None or out.is_contiguous()):
                return cublaslt.lt_linear(x, self.weight, algo, out)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        if out_features % tp_size():
            raise ValueError(f"output size {out_features} is not divisible by tensor parallel size {tp_size()}")
        super().__init__(in_features, out_features // tp_size(), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        default_weight_loader(param, _shard_rows(loaded, 0, tp_rank(), tp_size(), "output rows"))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one matrix (gate_up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        size = self.out_sizes[shard_id] // tp_size()
        offset = sum(self.out_sizes[:shard_id]) // tp_size()
        shard = _shard_rows(loaded, 0, tp_rank(), tp_size(), "output rows")
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix. With fewer kv heads than ranks, kv heads are replicated."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = tp_size()
        if num_heads % tp:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor parallel size {tp}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} and tensor parallel size {tp} do not divide")
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        LinearBase.__init__(self, hidden, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size = 0, q_size
            shard = _shard_rows(loaded, 0, tp_rank(), tp_size(), "q heads")
        else:
            offset, size = q_size + (kv_size if shard_id == "v" else 0), kv_size
            if loaded.shape[0] != self.total_kv_heads * self.head_dim:
                raise ValueError(
                    f"shape mismatch: {shard_id}_proj has {loaded.shape[0]} rows, "
                    f"model expects {self.total_kv_heads} kv heads x {self.head_dim}"
                )
            # rank r serves kv heads from r * total_kv // tp (several ranks share one when kv heads < tp)
            kv_head = tp_rank() * self.total_kv_heads // tp_size()
            shard = loaded.narrow(0, kv_head * self.head_dim, kv_size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed by an all-reduce, or, with
    ``reduce_results=False``, returned unsummed for the consumer to reduce (``RMSNorm.forward_partial``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True) -> None:
        if in_features % tp_size():
            raise ValueError(f"input size {in_features} is not divisible by tensor parallel size {tp_size()}")
        super().__init__(in_features // tp_size(), out_features, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias is added once, on rank 0 only
            default_weight_loader(param, loaded if tp_rank() == 0 else torch.zeros_like(loaded))
            return
        default_weight_loader(param, _shard_rows(loaded, 1, tp_rank(), tp_size(), "input columns"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce_results:
            return all_reduce(super().forward(x))
        out = partial_sum_buffer(x.shape[0], self.weight.shape[0], x.dtype, x.device) if x.dim() == 2 else None
        return super().forward(x, out)


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
        _check_shape(torch.empty(self.vocab_size, param.shape[1], device="meta"), loaded)
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
        logits = gather_to_rank0(F.linear(hidden, self.weight))
        return None if logits is None else logits[:, : self.vocab_size]

    def shard(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's logits (its shard's real token ids, without the padding) and the first one's token id."""
        valid = max(0, min(self.shard_size, self.vocab_size - self.start))
        return F.linear(hidden, self.weight[:valid]), self.start


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


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), cos/sin cached per position."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope(
    positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int, q_norm: RMSNorm, k_norm: RMSNorm, rope: RotaryEmbedding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then RoPE (torch). ``qk``: [tokens, q heads + k heads, head_dim], the q and k
    part of the qkv projection. On CUDA, PagedAttention.forward_qk_norm_rope does this in one fused kernel."""
    return rope(positions, q_norm(qk[:, :num_q_heads]), k_norm(qk[:, num_q_heads:]))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        """``forward`` for raw q/k projections ([tokens, q heads + k heads, head_dim], see ``qk_norm_rope``): on
        CUDA the per-head norms, RoPE and the KV store are one kernel, one launch fewer per layer."""
        if not qk.is_cuda:
            return self.forward(*qk_norm_rope(positions, qk, self.num_heads, q_norm, k_norm, rope), v)
        ctx = get_context()
        store = fused.KVStore(v, self.k_cache, self.v_cache, ctx.meta.slot_mapping)
        fused.qk_norm_rope_(
            qk, q_norm.weight, k_norm.weight, q_norm.eps, rope.cos_sin, positions, self.num_heads, store
        )
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
