"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader`` that takes the full checkpoint tensor
and copies this rank's shard into place, so loading needs no knowledge of the sharding scheme. A layer describes its
shard once (``shard``: which rows or columns of which checkpoint tensor land where), and the FP8 scales' loaders
(model/fp8_linear.py) read the same description in units of scale blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from comm.parallel import all_reduce, partial_sum_buffer, tp_rank, tp_size
from kernels import cublaslt, cublaslt_tune
from kernels.decode_gemm import decode_linear, decode_linear_add_norm, decode_linear_tiles, norm_gemv_tiles


def check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch{what}: checkpoint has {tuple(loaded.shape)}, model expects {tuple(param.shape)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    check_shape(param, loaded)
    param.data.copy_(loaded)


@dataclass(slots=True, frozen=True)
class Shard:
    """This rank's piece of one checkpoint tensor of shape ``full`` ([out rows, in columns]): ``size`` indices from
    ``start`` along ``dim`` (0: output rows, 1: input columns), copied to ``offset`` along that dim of the parameter."""

    full: tuple[int, int]
    dim: int
    start: int
    size: int
    offset: int = 0


class LinearBase(nn.Module):
    quant = None  # an FP8 method (model/fp8_linear.py) once the layer is quantized: it owns the forward

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def shard(self, shard_id: object = None) -> Shard:
        """Where this rank's part of the checkpoint tensor ``shard_id`` goes (unsharded: all of it, in place)."""
        rows, cols = self.weight.shape
        return Shard((rows, cols), 0, 0, rows)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        s = self.shard(shard_id)
        full = s.full[:1] if param.dim() == 1 else s.full  # a bias has the output rows only
        if tuple(loaded.shape) != full:
            raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects {full}")
        default_weight_loader(param.data.narrow(s.dim, s.offset, s.size), loaded.narrow(s.dim, s.start, s.size))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, into ``out`` when given (a contiguous [rows, out_features] tensor)."""
        if self.quant is not None:
            return self.quant.apply(self, x, out)
        if self.bias is None:
            tiles = decode_linear_tiles(x, self.weight)
            if tiles is not None:
                return decode_linear(x, self.weight, tiles, out)
            algo = cublaslt_tune.chosen_algo(x, self.weight) if x.is_cuda else None
            if algo is not None and (out is None or out.is_contiguous()):
                return cublaslt.lt_linear(x, self.weight, algo, out)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def takes_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether a kernel of this layer's forward may take the add + RMSNorm in front: on one rank (``x`` is the
        whole sum, nothing to reduce first), without a bias, on CUDA."""
        return residual is not None and tp_size() == 1 and self.bias is None and x.is_cuda and residual.is_contiguous()

    def norm_and_forward(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
        """(``self`` of ``norm(x + residual)``, ``x + residual``) with the norm fused for a GEMV: 16-bit weights in
        one launch of our GEMV, which norms the row itself; FP8 weights with the norm's kernel quantizing the row
        for the FP8 products. None where that does not apply (``takes_norm``, and the kernels' own limits), and the
        caller norms first."""
        if not self.takes_norm(x, residual):
            return None
        if self.quant is not None:
            return self.quant.apply_add_norm(self, x, residual, norm)
        tiles = norm_gemv_tiles(x, self.weight)
        return None if tiles is None else decode_linear_add_norm(x, residual, norm.weight, norm.eps, self.weight, tiles)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        if out_features % tp_size():
            raise ValueError(f"output size {out_features} is not divisible by tensor parallel size {tp_size()}")
        super().__init__(in_features, out_features // tp_size(), bias)

    def shard(self, shard_id=None):
        rows, cols = self.weight.shape
        return Shard((rows * tp_size(), cols), 0, tp_rank() * rows, rows)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one matrix (gate_up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def shard(self, shard_id=None):
        size = self.out_sizes[shard_id] // tp_size()
        offset = sum(self.out_sizes[:shard_id]) // tp_size()
        return Shard((self.out_sizes[shard_id], self.weight.shape[1]), 0, tp_rank() * size, size, offset)


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

    def shard(self, shard_id=None):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        cols = self.weight.shape[1]
        if shard_id == "q":
            return Shard((q_size * tp_size(), cols), 0, tp_rank() * q_size, q_size)
        # rank r serves kv heads from r * total_kv // tp (several ranks share one when kv heads < tp)
        kv_head = tp_rank() * self.total_kv_heads // tp_size()
        offset = q_size + (kv_size if shard_id == "v" else 0)
        return Shard((self.total_kv_heads * self.head_dim, cols), 0, kv_head * self.head_dim, kv_size, offset)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed by an all-reduce, or, with
    ``reduce_results=False``, returned unsummed for the consumer to reduce (``RMSNorm.forward_partial``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True) -> None:
        if in_features % tp_size():
            raise ValueError(f"input size {in_features} is not divisible by tensor parallel size {tp_size()}")
        super().__init__(in_features // tp_size(), out_features, bias)
        self.reduce_results = reduce_results

    def shard(self, shard_id=None):
        rows, cols = self.weight.shape
        return Shard((rows, cols * tp_size()), 1, tp_rank() * cols, cols)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias is added once, on rank 0 only
            default_weight_loader(param, loaded if tp_rank() == 0 else torch.zeros_like(loaded))
            return
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(super().forward(x, self.output_buffer(x)))

    def output_buffer(self, x: torch.Tensor) -> torch.Tensor | None:
        """Where the output for input rows ``x`` goes: unsummed, the buffer the consumer's fused all-reduce reads;
        else a new tensor (None)."""
        if self.reduce_results or x.dim() != 2:
            return None
        return partial_sum_buffer(x.shape[0], self.weight.shape[0], x.dtype, x.device)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's result from this rank's product ``y``: summed over the ranks unless the consumer does it."""
        return all_reduce(y) if self.reduce_results else y
