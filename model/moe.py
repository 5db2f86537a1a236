"""A mixture-of-experts MLP: a replicated router and the layer's experts stacked into two parameters.

Under tensor parallelism every rank holds every expert's slice of the intermediate dimension (gate/up rows,
down columns), like the dense MLP's column/row split, and returns its partial sum: the RMSNorm after the layer
reduces it (``RMSNorm.forward_partial``), so the layer costs one all-reduce. On CUDA the experts run fused in
Triton (kernels/fused_moe.py), a decode batch of a few tokens (``uses_moe_decode``) as two GEMV kernels
(kernels/moe_decode.py); elsewhere a plain torch path groups the pairs by expert and loops over experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from comm.parallel import partial_sum_buffer, tp_rank, tp_size
from kernels.fused_moe import fused_experts, fused_moe
from kernels.moe_decode import uses_moe_decode
from kernels.moe_norm_route import norm_route
from model.layers import RMSNorm
from model.linear import LinearBase, check_shape

# checkpoint projection of one expert -> (stacked parameter, block of rows in it: 0 = gate, 1 = up)
EXPERT_PROJECTIONS = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}


def route_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router: softmax in float32, top-k, optionally renormalized; (weights float32, expert ids int64)."""
    weights, ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]): pairs sorted by expert, one matmul pair per expert hit."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # a host sync: this path is for the CPU
    y = x.new_zeros(num_tokens * top_k, w2.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        if count:
            pairs = order[start : start + count]
            gate, up = F.linear(x[pairs // top_k], w13[expert]).chunk(2, dim=-1)
            y[pairs] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    y = y * weights.reshape(-1, 1).to(y.dtype)
    return y.view(num_tokens, top_k, -1).sum(1)


class FusedMoE(nn.Module):
    """The experts of one layer: ``w13_weight`` [E, 2 * I / tp, H] (this rank's gate rows, then its up rows) and
    ``w2_weight`` [E, H, I / tp]; forward(x, router_logits) returns this rank's partial sums."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool) -> None:
        super().__init__()
        tp = tp_size()
        if intermediate % tp:
            raise ValueError(f"moe_intermediate_size={intermediate} is not divisible by tensor parallel size {tp}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter = intermediate // tp
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, self.inter), requires_grad=False)
        for param, names in ((self.w13_weight, ("gate_proj", "up_proj")), (self.w2_weight, ("down_proj",))):
            param.weight_loader = self.weight_loader
            # the loader's (expert, projection) shard ids: each must come from the checkpoint exactly once
            param.checkpoint_shards = [(e, name) for e in range(num_experts) for name in names]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has num_experts={self.num_experts}")
        _, block = EXPERT_PROJECTIONS[proj]
        split_dim = 1 if block is None else 0  # down splits its input columns, gate and up their output rows
        full = self.inter * tp_size()
        if loaded.dim() != 2 or loaded.shape[split_dim] != full:
            raise ValueError(
                f"shape mismatch: expert {proj} has shape {tuple(loaded.shape)}, model expects dimension "
                f"{split_dim} of moe_intermediate_size={full}"
            )
        shard = loaded.narrow(split_dim, tp_rank() * self.inter, self.inter)
        dst = param.data[expert] if block is None else param.data[expert].narrow(0, block * self.inter, self.inter)
        check_shape(dst, shard)
        dst.copy_(shard)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            weights, ids = route_torch(router_logits, self.top_k, self.renormalize)
            return experts_torch(x, self.w13_weight, self.w2_weight, weights, ids)
        out = partial_sum_buffer(x.shape[0], self.w2_weight.shape[1], x.dtype, x.device)
        return fused_moe(x, router_logits, self.w13_weight, self.w2_weight, self.top_k, self.renormalize, out)


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated on every rank) + experts; checkpoint names ``mlp.gate.weight`` and
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool) -> None:
        super().__init__()
        self.gate = LinearBase(hidden, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden, intermediate, renormalize)
        self.front_on_cpu = False  # tests set it to run the front in Triton's interpreter on CPU tensors
        # the one-launch front's ticket (kernels/moe_norm_route.py): zero between launches, one per layer
        self.register_buffer("route_ticket", torch.zeros(1, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))

    def norm_and_forward(
        self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer after attention, from the norm in front of it on: (output, residual stream) with the norm,
        router and routing as one launch (kernels/moe_norm_route.py) where that applies (CUDA, one rank, a decode
        batch of a few tokens, a plain 16-bit router; on the CPU only where a test asks); None elsewhere,
        for the caller to run them apart."""
        if not (hidden.is_cuda or self.front_on_cpu):
            return None
        router = self.gate
        plain_router = router.bias is None and router.weight.dtype == hidden.dtype  # unbiased, not quantized
        if tp_size() > 1 or not uses_moe_decode(hidden.shape[0]) or not plain_router:
            return None
        e = self.experts
        h, residual, weights, ids = norm_route(
            hidden, residual, norm.weight, norm.eps, router.weight, e.top_k, e.renormalize, self.route_ticket
        )
        return fused_experts(h, e.w13_weight, e.w2_weight, weights, ids), residual
