"""Tensor-parallel state and collectives. At tp size 1 every collective is a no-op.

On CUDA with tp > 1, ``all_reduce`` and ``all_reduce_add_rmsnorm`` take the symmetric-memory paths of
comm/custom_all_reduce.py once its ``init_custom_all_reduce`` has set them up; NCCL otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from comm.symm_reducers import FusedAllReduceNorm, SymmAllReduce


@dataclass(slots=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup, None = default group


@dataclass(slots=True)
class CustomReducers:
    """The symmetric-memory all-reduces in use (comm/custom_all_reduce.py sets them); None: NCCL."""

    symm: SymmAllReduce | None = None
    fused: FusedAllReduceNorm | None = None


_TP = TPState()
REDUCERS = CustomReducers()


def set_tp(rank: int, size: int, group: object | None = None) -> None:
    _TP.rank, _TP.size, _TP.group = rank, size, group
    # a symmetric buffer belongs to one group: init_custom_all_reduce again after a change
    REDUCERS.symm = REDUCERS.fused = None


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.size


def tp_group() -> object | None:
    """The TP process group (None: the default group)."""
    return _TP.group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group in place and return it."""
    if _TP.size > 1:
        symm = REDUCERS.symm
        if symm is not None and x.is_cuda and symm.accepts(x):
            return symm(x)
        dist.all_reduce(x, group=_TP.group)
    return x


def all_reduce_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm of (the sum of ``x`` over the TP group [+ residual]) in one kernel, as ``fused.rmsnorm`` returns
    it; None where that kernel does not apply (the caller then all-reduces and normalizes separately)."""
    fused = REDUCERS.fused
    if fused is None or not x.is_cuda or not fused.fits(x, residual):
        return None
    return fused(x, residual, weight, eps)


def partial_sum_buffer(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Where a row-parallel projection whose partial sums go next to ``all_reduce_add_rmsnorm`` should write
    them (a view of the fused kernel's buffer, which spares the kernel a copy), or None for a fresh tensor."""
    fused = REDUCERS.fused
    if fused is None or device.type != "cuda":
        return None
    return fused.next_input(rows, cols, dtype)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.broadcast(x, src=0, group=_TP.group)
    return x


def all_gather_stack(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order ([tp, *x.shape]), on every rank."""
    if _TP.size == 1:
        return x[None]
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.stack(parts)


def gather_to_rank0(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's last-dim shard on rank 0; other ranks get None (they never hold full logits)."""
    if _TP.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.size)] if _TP.rank == 0 else None
    dist.gather(x, parts, dst=0, group=_TP.group)
    return torch.cat(parts, dim=-1) if _TP.rank == 0 else None
