"""Fused mixture-of-experts on CUDA in Triton, and the MoE layer's one entry point (``fused_moe``: routing, then
``fused_experts``), which model/moe.py calls. A decode batch of a few tokens takes the two GEMV kernels of
kernels/moe_decode.py; other batches two grouped GEMMs over the token-expert pairs grouped by expert
(kernels/moe_routing.py), each row block multiplying by its expert's weights:

  gate/up: h[p] = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T) for pair p = (token t, expert e), SiLU-and-mul in the
           epilogue (one program computes the matching gate and up column tiles);
  down:    y[p] = weight[p] * (h[p] @ down_e.T), the routing weight folded into the epilogue;
  out[t] = sum over t's top_k pairs of y[p], in slot order (deterministic, no atomics).

Weights are stacked per expert as the linear layers store them: w13 [E, 2 * I, H] (gate rows, then up rows), w2
[E, H, I]. Rounding follows HF's Qwen3-MoE: the gate and up products are rounded to the model dtype before the
activation, the activation is rounded before the product. Grids and buffers depend only on the token count
(blocks past the rows in use return at once), so the whole layer captures in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe_decode import DecodeTiles, decode_experts, uses_moe_decode
from kernels.moe_routing import ExpertGroups, align_by_expert, route
from kernels.pdl import pdl_enter, use_pdl


@dataclass(slots=True, frozen=True)
class MoeTiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def moe_tiles(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """Tiles for H200-class GPUs (bf16 tl.dot: wgmma from 64 rows up). The row block follows the expected pairs per
    expert so that, at decode sizes, nearly every expert's group fits one block (each weight tile read once; the
    idle rows cost nothing in a memory-bound product) while the weights stream through wide K tiles; with many
    pairs per expert 64-row blocks reuse each weight tile over more rows."""
    per_expert = num_tokens * top_k / num_experts
    wide = 1 if dtype.itemsize <= 2 else 2  # float32 tiles take twice the shared memory
    if per_expert <= 8:
        return MoeTiles(16, 64, 128 // wide, 1, 4, 4)
    if per_expert <= 20:
        return MoeTiles(32, 64, 128 // wide, 4, 4, 4)
    return MoeTiles(64, 128 // wide, 64, 8, 4, 3)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 models: full precision, so greedy tokens match HF's on GPUs too
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks_m"])
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    route_w_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_rows_ptr,
    N,
    K,
    num_pairs,
    max_blocks_m,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_ROWS_PER_PAIR: tl.constexpr,  # top_k for gate/up (x is read per token), 1 for down (h is read per pair)
    GATED: tl.constexpr,
    SCALE_BY_ROUTE: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grouped order: GROUP_M row blocks share each column tile while it is in L2
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(max_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    pdl_enter(USE_PDL)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROWS_PER_PAIR).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = offs_n % N  # columns past N read a valid column and are never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + w_cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _dot(a, w, acc, IEEE)
        if GATED:
            if EVEN_K:
                up = tl.load(up_ptrs)
            else:
                up = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
            acc_up = _dot(a, up, acc_up, IEEE)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    if SCALE_BY_ROUTE:
        acc = acc * tl.load(route_w_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(dtype), mask=row_ok[:, None] & (offs_n[None, :] < N))


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    groups: ExpertGroups,
    tiles: MoeTiles,
    a_rows_per_pair: int,
    gated: bool,
    route_weights: torch.Tensor | None = None,
) -> None:
    """out[p] (a row per pair) = a[p // a_rows_per_pair] @ w[expert of p].T, gated or scaled (module docstring)."""
    num_pairs, n = out.shape
    k = a.shape[1]
    if w.stride(2) != 1 or a.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("grouped_gemm needs unit inner strides")
    max_blocks_m = groups.block_experts.shape[0]
    grid = (max_blocks_m * triton.cdiv(n, tiles.block_n),)
    pdl = use_pdl(a)
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        route_weights if route_weights is not None else out,
        groups.sorted_pairs,
        groups.block_experts,
        groups.num_rows,
        n,
        k,
        num_pairs,
        max_blocks_m,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_ROWS_PER_PAIR=a_rows_per_pair,
        GATED=gated,
        SCALE_BY_ROUTE=route_weights is not None,
        EVEN_K=k % tiles.block_k == 0,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m,
        USE_PDL=pdl,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        launch_pdl=pdl,
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    route_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    tiles: MoeTiles | DecodeTiles | None = None,
) -> torch.Tensor:
    """sum_j route_weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t, into ``out`` when given ([T, H]).
    ``tiles`` picks the kernels: DecodeTiles the GEMVs, MoeTiles the grouped GEMMs; None the GEMVs for a batch of
    a few tokens (``uses_moe_decode``; they need ``route``'s float32 weights and int32 ids), else the grouped GEMMs
    at ``moe_tiles``'."""
    num_tokens, hidden = x.shape
    if isinstance(tiles, DecodeTiles) or (tiles is None and uses_moe_decode(num_tokens)):
        return decode_experts(x, w13, w2, route_weights, expert_ids, out, tiles)
    num_experts, two_inter, _ = w13.shape
    top_k = expert_ids.shape[1]
    if tiles is None:
        tiles = moe_tiles(num_tokens, top_k, num_experts, x.dtype)
    groups = align_by_expert(expert_ids, num_experts, tiles.block_m)
    h = torch.empty(num_tokens * top_k, two_inter // 2, dtype=x.dtype, device=x.device)
    y = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    if num_tokens:
        grouped_gemm(x, w13, h, groups, tiles, top_k, gated=True)
        grouped_gemm(h, w2, y, groups, tiles, 1, gated=False, route_weights=route_weights.reshape(-1))
    y = y.view(num_tokens, top_k, hidden)
    if out is None:
        return y.sum(1) if top_k > 1 else y[:, 0]
    return torch.sum(y, dim=1, out=out)


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    out: torch.Tensor | None = None,
    tiles: MoeTiles | DecodeTiles | None = None,
) -> torch.Tensor:
    """A whole MoE layer after its router: route, then ``fused_experts`` (``tiles`` as there)."""
    route_weights, expert_ids = route(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, route_weights, expert_ids, out, tiles)
