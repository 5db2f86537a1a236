"""Mixture-of-experts for decode batches of a few tokens (T <= MAX_TOKENS): after the routing kernel
(kernels/moe_routing.py ``route``), two GEMV kernels instead of the grouping, two grouped GEMMs and a torch sum
of kernels/fused_moe.py, whose ``fused_experts`` (the layer's one entry point) launches them.

  gate/up: grid (pair p = t * top_k + j, tiles of the intermediate dim). Each program reads its expert id, loads
           the matching gate and up rows of w13 [E, 2I, H] (a ~32 KB slice, the whole row up to 4096 wide),
           multiplies them by x[t], sums along H in float32 and writes h[p] = silu(gate) * up;
  down:    grid (token t, tiles of the hidden dim). Each program loads its tile's rows of w2 [E, H, I] from all of
           t's top_k experts at once, y_j = weight[t, j] * (h[p_j] @ w2[e_j, tile].T), and writes
           out[t, tile] = sum of the y_j in slot order j = 0..top_k-1 (deterministic, no atomics).

At one token a grouped GEMM runs one 16-row block per expert and few programs per block (96 for Qwen3-30B-A3B's
gate/up), so half the GPU's bandwidth goes unused; here thousands of programs each stream one small slice.
The expert ids come from the routing kernel in front, so gate/up loads no weight before its PDL wait; the down
kernel, one launch further, loads its first weight step before its own wait, while gate/up finishes.

Rounding follows fused_moe's epilogues exactly: gate and up rounded to the model dtype, SiLU in float32 rounded,
their product rounded; each y_j = (float32 product * routing weight) rounded; the top_k rounded values summed in
float32 in slot order and rounded once (torch.sum's float32 accumulation). The sums along H and I are tl.sum
trees where fused_moe's are tl.dot chains (tensor-core MMAs on a GPU), so the float32 accumulators differ in
their last bits and the outputs are not bitwise equal in general; where every accumulation is exact they are
(tests/kernels/test_moe_decode.py). Grids depend only on the token count and the shapes: the layer captures in
CUDA graphs. ``fused_experts`` takes this path for T <= MAX_TOKENS (benchmarks/moe_kernel.py --path both times the
two).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, use_pdl

MAX_TOKENS = 4  # the GEMVs re-read an expert's slice per token sharing it; more tokens go to the grouped GEMMs
_SLICE = 8192  # weight elements a down program loads a step (16 KB in bf16), as decode_gemm's GEMV
_GATE_UP_SLICE = 16384  # a gate/up program's (32 KB): 29.1 against 30.6 us a layer at 16 KB (H200, 1 token)
_MAX_ROW = 4096  # widest row a program loads whole; wider rows are looped over
_WARP_BYTES = 32 * 1024  # weight bytes a 4-warp program holds (64 registers a thread); twice that takes 8 warps


class DecodeTiles(NamedTuple):
    """``block_i`` gate rows (and as many up rows) per gate/up program, ``block_h`` hidden columns per step;
    ``block_n`` output columns per down program, ``block_k`` intermediate columns per step (all top_k experts);
    warps of each kernel."""

    block_i: int
    block_h: int
    block_n: int
    block_k: int
    warps_gate_up: int
    warps_down: int


def decode_tiles(hidden: int, inter: int, top_k: int, dtype: torch.dtype = torch.bfloat16) -> DecodeTiles:
    """Qwen3-30B-A3B's gate/up programs load 4 gate + 4 up rows of 2048 (32 KB, whole rows), its down programs 4 rows
    of 8 experts' 768 in 3 steps of 256 (16 KB each, the first before the PDL wait); Triton 3.6's sm_90a builds take
    96 registers each, 5 programs an SM (tests/support/moe_sm90_build.py; whole 1,024-wide down rows took 217
    registers with the early load, 2 programs an SM). On an H200, `benchmarks.moe_kernel --path decode --layers 4`
    over 8 tilings: 16 KB or 64 KB gate/up slices, 8 warps, down tiles of 2 or 8 rows, or steps of 128 or 512 were
    all 5-14% slower at one token. 8 warps where 4 would need more than 64 registers a thread for the weights
    (float32)."""
    block_h = min(triton.next_power_of_2(hidden), _MAX_ROW)
    block_i = max(2, min(_GATE_UP_SLICE // (2 * block_h), triton.next_power_of_2(inter)))  # no 1-wide tiles
    k_pow2 = max(2, triton.next_power_of_2(top_k))
    block_k = min(triton.next_power_of_2(inter), _SLICE // (4 * k_pow2))
    block_n = max(2, _SLICE // (k_pow2 * block_k))
    gate_up, down = 2 * block_i * block_h * dtype.itemsize, k_pow2 * block_n * block_k * dtype.itemsize
    return DecodeTiles(block_i, block_h, block_n, block_k, _warps(gate_up), _warps(down))


def _warps(weight_bytes: int) -> int:
    return 4 if weight_bytes <= _WARP_BYTES else 8


def uses_moe_decode(num_tokens: int) -> bool:
    """Whether a batch of ``num_tokens`` tokens takes this path rather than the grouped GEMMs (``fused_experts``)."""
    return 0 < num_tokens <= MAX_TOKENS


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    h_ptr,
    inter,
    hidden,
    stride_xm,
    stride_we,
    stride_wn,
    stride_hm,
    TOP_K: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pair = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_h = tl.arange(0, BLOCK_H)
    i_ok = offs_i < inter
    # The expert id is the routing kernel's output: nothing to load before the wait. The signal comes after it,
    # because the down kernel behind loads these ids before its own wait.
    pdl_enter(USE_PDL, SIGNAL_FIRST=False)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_ptrs = x_ptr + (pair // TOP_K) * stride_xm + offs_h
    gate_ptrs = w_ptr + expert * stride_we + offs_i[:, None].to(tl.int64) * stride_wn + offs_h[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_I,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        if EVEN_H:
            x = tl.load(x_ptrs + h0)
            gate = tl.load(gate_ptrs + h0, mask=i_ok[:, None], other=0.0)
            up = tl.load(up_ptrs + h0, mask=i_ok[:, None], other=0.0)
        else:
            h_ok = offs_h < hidden - h0
            x = tl.load(x_ptrs + h0, mask=h_ok, other=0.0)
            gate = tl.load(gate_ptrs + h0, mask=i_ok[:, None] & h_ok[None, :], other=0.0)
            up = tl.load(up_ptrs + h0, mask=i_ok[:, None] & h_ok[None, :], other=0.0)
        x = x.to(tl.float32)[None, :]
        acc_gate += tl.sum(gate.to(tl.float32) * x, axis=1)
        acc_up += tl.sum(up.to(tl.float32) * x, axis=1)
    # fused_moe's GATED epilogue, operation for operation
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = act * acc_up.to(dtype).to(tl.float32)
    tl.store(h_ptr + pair * stride_hm + offs_i, h.to(dtype), mask=i_ok)


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    route_w_ptr,
    out_ptr,
    hidden,
    inter,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, K_POW2)
    slot_ok = slots < TOP_K
    pairs = token * TOP_K + slots
    w_ok = slot_ok[:, None, None] & (offs_n < hidden)[None, :, None]
    # The ids come from the routing kernel in front of gate/up, complete before gate/up lets this kernel launch
    # (its pdl_enter signals after its wait): the first weight step loads before our wait, overlapping gate/up's
    # tail; h only after it.
    # Read past L1 (.cg): a buffer of an earlier layer may have held them at the same address.
    experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0, cache_modifier=".cg").to(tl.int64)
    w_ptrs = w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
    w_ptrs += offs_k[None, None, :]
    h_ptrs = h_ptr + pairs[:, None] * stride_hm + offs_k[None, :]
    k_ok = offs_k < inter
    w = tl.load(w_ptrs, mask=w_ok & k_ok[None, None, :], other=0.0)
    pdl_enter(USE_PDL)
    h = tl.load(h_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
    acc = tl.sum(w.to(tl.float32) * h.to(tl.float32)[:, None, :], axis=2)
    for k0 in range(BLOCK_K, inter, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptrs + k0, mask=slot_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=w_ok, other=0.0)
        else:
            k_ok = offs_k < inter - k0
            h = tl.load(h_ptrs + k0, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=w_ok & k_ok[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * h.to(tl.float32)[:, None, :], axis=2)
    # fused_moe's SCALE_BY_ROUTE epilogue per slot, then torch.sum's float32 accumulation in slot order
    dtype = out_ptr.dtype.element_ty
    y = (acc * tl.load(route_w_ptr + pairs, mask=slot_ok, other=0.0)[:, None]).to(dtype).to(tl.float32)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.sum(tl.where(slots[:, None] == j, y, 0.0), axis=0)  # y_j alone: adding zeros is exact
    tl.store(out_ptr + token * stride_om + offs_n, total.to(dtype), mask=offs_n < hidden)


def decode_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    route_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    out: torch.Tensor | None,
    tiles: DecodeTiles | None,
) -> torch.Tensor:
    """sum_j route_weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t, into ``out`` when given ([T, H]);
    ``route_weights`` float32 and ``expert_ids`` int32, both [T, top_k] and contiguous (``route``'s outputs)."""
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    top_k = expert_ids.shape[1]
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1 or out.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("moe_decode needs unit inner strides")
    routing = (route_weights.dtype, expert_ids.dtype) == (torch.float32, torch.int32)
    if not (routing and route_weights.is_contiguous() and expert_ids.is_contiguous()):
        raise ValueError("moe_decode needs route's contiguous float32 weights and int32 ids")
    if num_tokens == 0:
        return out
    t = tiles or decode_tiles(hidden, inter, top_k, x.dtype)
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, t.block_i))](
        x,
        w13,
        expert_ids,
        h,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        TOP_K=top_k,
        BLOCK_I=t.block_i,
        BLOCK_H=t.block_h,
        EVEN_H=hidden % t.block_h == 0,
        USE_PDL=pdl,
        num_warps=t.warps_gate_up,
        num_stages=1,  # one whole-row step: nothing to pipeline
        launch_pdl=pdl,
    )
    _down_kernel[(num_tokens, triton.cdiv(hidden, t.block_n))](
        h,
        w2,
        expert_ids,
        route_weights,
        out,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        TOP_K=top_k,
        K_POW2=max(2, triton.next_power_of_2(top_k)),
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        EVEN_K=inter % t.block_k == 0,
        USE_PDL=pdl,
        num_warps=t.warps_down,
        num_stages=1,
        launch_pdl=pdl,
    )
    return out
