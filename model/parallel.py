"""Tensor-parallel state and collectives. At tp size 1 every collective is a no-op."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup, None = default group


_TP = TPState()


def set_tp(rank: int, size: int, group: object | None = None) -> None:
    _TP.rank, _TP.size, _TP.group = rank, size, group


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.all_reduce(x, group=_TP.group)
    return x


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.broadcast(x, src=0, group=_TP.group)
    return x


def gather_to_rank0(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's last-dim shard on rank 0; other ranks get None (they never hold full logits)."""
    if _TP.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.size)] if _TP.rank == 0 else None
    dist.gather(x, parts, dst=0, group=_TP.group)
    return torch.cat(parts, dim=-1) if _TP.rank == 0 else None
