"""Where each checkpoint tensor goes: the parameter, its ``weight_loader`` and shard id (fused q/k/v and gate/up,
stacked experts), and which rows of the tensor this tensor-parallel rank needs, so that it reads only those bytes.

Rows, not columns: a slice along dim 0 of a row-major tensor is one contiguous byte range, a slice along dim 1 (a
row-parallel layer's input columns) is a stride of short pieces, so those tensors are read whole and the loader cuts
them. Only loaders whose cut we know (``rows``) are read in part; any other reads the whole tensor, which is always
correct, since every loader takes the full checkpoint tensor and cuts its own shard."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from torch import nn

from comm.parallel import tp_rank, tp_size
from model.fp8_linear import _load_fp8_weight
from model.layers import VocabParallelEmbedding
from model.linear import LinearBase, RowParallelLinear
from model.moe import EXPERT_PROJECTIONS, FusedMoE
from model.safetensors_reader import TensorEntry

# a per-expert checkpoint tensor: "<prefix>.experts.<expert>.<projection>.weight"
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


@dataclass(slots=True, frozen=True)
class Target:
    """The destination of one checkpoint tensor: ``key`` = (our parameter's name, shard id) is what the missing-tensor
    check counts; ``loader`` None copies the whole tensor into ``param``."""

    key: tuple[str, object]
    param: nn.Parameter
    loader: Callable | None


class CheckpointPlan:
    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.mapping = getattr(model, "packed_modules_mapping", {})
        # projection -> stacked parameter, for models whose experts live in one parameter per projection kind
        self.experts = getattr(model, "expert_params_mapping", {})
        self.tied = getattr(model.config, "tie_word_embeddings", False)

    def target(self, ckpt_name: str) -> Target | None:
        """Where checkpoint tensor ``ckpt_name`` goes; None for tensors we do not use (e.g. extra heads)."""
        if "rotary_emb.inv_freq" in ckpt_name or (self.tied and ckpt_name == "lm_head.weight"):
            return None
        name, shard = ckpt_name, None
        expert = _EXPERT_TENSOR.search(ckpt_name) if self.experts else None
        if expert is not None and expert[2] in self.experts:
            name = f"{ckpt_name[: expert.start()]}.experts.{self.experts[expert[2]]}"
            shard = (int(expert[1]), expert[2])
        else:
            for src, (dst, shard_id) in self.mapping.items():
                if f".{src}." in ckpt_name:
                    name, shard = ckpt_name.replace(f".{src}.", f".{dst}."), shard_id
                    break
        param = self.params.get(name)
        if param is None:
            return None
        return Target((name, shard), param, getattr(param, "weight_loader", None))

    def expected(self) -> Iterator[tuple[str, object]]:
        """Every (parameter, shard id) the checkpoint must provide."""
        for name, param in self.params.items():
            if self.tied and name == "lm_head.weight":
                continue
            own = getattr(param, "checkpoint_shards", None)  # stacked experts: (expert, projection) each
            if own is not None:
                yield from ((name, s) for s in own)
                continue
            shards = [shard for _, (dst, shard) in self.mapping.items() if f".{dst}." in name]
            yield from ((name, s) for s in shards) if shards else [(name, None)]

    def checkpoint_name(self, key: tuple[str, object]) -> str:
        """The checkpoint's own name for a (parameter, shard id), for error messages."""
        name, shard = key
        if isinstance(shard, tuple):  # (expert, projection) of a stacked expert parameter "<prefix>.experts.<param>"
            return f"{name.rsplit('.', 1)[0]}.{shard[0]}.{shard[1]}.weight"
        for src, (dst, shard_id) in self.mapping.items():
            if f".{dst}." in name and shard_id == shard:
                return name.replace(f".{dst}.", f".{src}.")
        return name


def rows(target: Target, entry: TensorEntry) -> tuple[int, int]:
    """The rows [lo, hi) of ``entry`` this rank's loader reads: a contiguous slice for loaders that cut along dim 0
    under tensor parallelism, else all of them. Clamped to the tensor: a wrong shape is the loader's to report."""
    span = _dim0_span(target) if tp_size() > 1 and entry.shape else None
    if span is None:
        return 0, entry.rows
    lo = min(span[0], entry.rows)
    return lo, max(lo, min(span[1], entry.rows))


def _dim0_span(target: Target) -> tuple[int, int] | None:
    loader, shard = target.loader, target.key[1]
    if isinstance(loader, partial) and loader.func is _load_fp8_weight:  # an e4m3 weight: cut as its layer's
        return _linear_span(loader.args[0], shard, target.param.dim())
    owner, func = getattr(loader, "__self__", None), getattr(loader, "__func__", None)
    if isinstance(owner, LinearBase) and func in (LinearBase.weight_loader, RowParallelLinear.weight_loader):
        return _linear_span(owner, shard, target.param.dim())
    if isinstance(owner, VocabParallelEmbedding) and func is VocabParallelEmbedding.weight_loader:
        return owner.start, owner.start + owner.shard_size
    if isinstance(owner, FusedMoE) and func is FusedMoE.weight_loader:
        if EXPERT_PROJECTIONS[shard[1]][1] is None:  # down_proj: its input columns are split
            return None
        return tp_rank() * owner.inter, (tp_rank() + 1) * owner.inter
    return None


def _linear_span(layer: LinearBase, shard: object, param_dim: int) -> tuple[int, int] | None:
    if isinstance(layer, RowParallelLinear) and param_dim == 1:  # its bias: whole on rank 0, zeros elsewhere
        return None
    s = layer.shard(shard)
    return (s.start, s.start + s.size) if s.dim == 0 else None
