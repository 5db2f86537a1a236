"""Mixture-of-experts routing on CUDA in Triton: which experts each token goes to, and the token-expert pairs
grouped by expert for the grouped GEMMs of kernels/fused_moe.py.

``route``: softmax over the router logits (float32, as HF), top-k by repeated argmax, optional renormalization.
``align_by_expert``: pair p = token * top_k + j. The pairs are laid out expert by expert, each expert's group
padded to a multiple of the GEMM's row block, so every row block belongs to one expert. Nothing is read back
to the host and every buffer is sized for the worst case of the pair count, so both capture in CUDA graphs.
Up to ``ONE_PROGRAM_MAX_PAIRS`` pairs (every decode batch) the grouping is one single-program kernel;
above it three kernels split the pairs into chunks: count per chunk, offsets, scatter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, use_pdl

ONE_PROGRAM_MAX_PAIRS = 4096  # 512 decode tokens at top-8 still group in one launch
ONE_PROGRAM_BLOCK = 512  # pairs per loop step there: one compiled variant for every pair count
CHUNK_PAIRS = 4096  # pairs per program of the multi-kernel grouping


@triton.jit
def route_tile(x, E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """HF's routing of router logits ``x`` [rows, E_POW2] in float32 (padding experts -inf, padding rows finite):
    softmax, top-k by repeated argmax (the lowest index among equal maxima), optionally renormalized; returns the
    weights and expert ids [rows, K_POW2] (slots past TOP_K zero)."""
    cols = tl.arange(0, E_POW2)
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    slots = tl.arange(0, K_POW2)
    top_w = tl.zeros((x.shape[0], K_POW2), dtype=tl.float32)
    top_i = tl.zeros((x.shape[0], K_POW2), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=1)
        best_w = tl.max(probs, axis=1)
        top_w = tl.where(slots[None, :] == j, best_w[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, best[:, None].to(tl.int32), top_i)
        probs = tl.where(cols[None, :] == best[:, None], -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    return top_w, top_i


@triton.jit
def route_rows(x, rows, row_ok, weights_ptr, ids_ptr, E_POW2: tl.constexpr, TOP_K: tl.constexpr,
               K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):  # fmt: skip
    """Route the logits ``x`` [R, E_POW2] of token ``rows`` (float32, padding experts -inf) and store the weights
    and expert ids of the rows in ``row_ok`` at [token, slot]; padding rows are routed from zeros, not stored."""
    x = tl.where(row_ok[:, None], x, 0.0)
    top_w, top_i = route_tile(x, E_POW2, TOP_K, K_POW2, RENORMALIZE)
    slots = tl.arange(0, K_POW2)
    out = rows[:, None] * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=keep)
    tl.store(ids_ptr + out, top_i, mask=keep)


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_l,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_POW2)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=mask, other=-float("inf"))
    route_rows(x.to(tl.float32), rows, row_ok, weights_ptr, ids_ptr, E_POW2, TOP_K, K_POW2, RENORMALIZE)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights (float32) and expert ids (int32), both [tokens, top_k], from router logits [tokens, E]."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    e_pow2 = triton.next_power_of_2(num_experts)
    block_t = max(1, min(32, 4096 // e_pow2))  # fixed per expert count: one compiled variant
    pdl = use_pdl(logits)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        weights,
        ids,
        num_tokens,
        logits.stride(0),
        E=num_experts,
        E_POW2=e_pow2,
        TOP_K=top_k,
        K_POW2=max(2, triton.next_power_of_2(top_k)),  # no 1-wide tiles
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return weights, ids


class ExpertGroups(NamedTuple):
    """Token-expert pairs grouped by expert. ``sorted_pairs[i]``: the pair in row i of the grouped layout (padding
    rows hold the pair count, an invalid pair); ``block_experts[b]``: the expert of row block b;
    ``num_rows``: [1], rows in use (a multiple of ``block_m``); blocks at or past it are not read."""

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    num_rows: torch.Tensor
    block_m: int


def max_grouped_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the grouped layout in the worst case: every non-empty group pads by up to block_m - 1."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


@triton.jit
def _group_layout(counts, e, sorted_ptr, block_expert_ptr, num_rows_ptr, num_pairs, E, BLOCK_M: tl.constexpr):
    """From per-expert pair counts: write the padding rows, each block's expert and the rows in use; returns
    each expert's first row."""
    counts = tl.where(e < E, counts, 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(num_rows_ptr, total)
    pad = tl.arange(0, BLOCK_M)
    pad_rows = (starts + counts)[:, None] + pad[None, :]
    tl.store(sorted_ptr + pad_rows, num_pairs + 0 * pad_rows, mask=pad[None, :] < (padded - counts)[:, None])
    for b0 in range(0, tl.cdiv(total, BLOCK_M), 64):
        blocks = b0 + tl.arange(0, 64)
        first_row = blocks * BLOCK_M
        # a block's expert = the number of experts whose rows end at or before its first row
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, expert, mask=first_row < total)
    return starts


@triton.jit(do_not_specialize=["num_pairs"])
def _group_one_program_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_rows_ptr,
    cursor_ptr,
    num_pairs,
    E,
    E_POW2: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    e = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E)  # masked lanes count into bin E, dropped
        counts += tl.histogram(ids, E_POW2)
    starts = _group_layout(counts, e, sorted_ptr, block_expert_ptr, num_rows_ptr, num_pairs, E, BLOCK_M)
    tl.store(cursor_ptr + e, starts)
    tl.debug_barrier()  # every thread's cursor stores land before any thread's atomics read them
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0)
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)  # order within a group is free: GEMM rows are independent
        tl.store(sorted_ptr + row, offs, mask=ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_chunks_kernel(ids_ptr, counts_ptr, num_pairs, E, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E)
    tl.store(counts_ptr + chunk * E_POW2 + tl.arange(0, E_POW2), tl.histogram(ids, E_POW2))


@triton.jit(do_not_specialize=["num_chunks", "num_pairs"])
def _chunk_offsets_kernel(
    counts_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_chunks,
    num_pairs,
    E,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Turns each chunk's counts row into that chunk's first row per expert (its scatter cursor), in place."""
    e = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for c in range(num_chunks):
        counts += tl.load(counts_ptr + c * E_POW2 + e)
    cursor = _group_layout(counts, e, sorted_ptr, block_expert_ptr, num_rows_ptr, num_pairs, E, BLOCK_M)
    for c in range(num_chunks):
        mine = tl.load(counts_ptr + c * E_POW2 + e)
        tl.store(counts_ptr + c * E_POW2 + e, cursor)
        cursor += mine


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_chunks_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    row = tl.atomic_add(cursor_ptr + chunk * E_POW2 + ids, 1, mask=ok)
    tl.store(sorted_ptr + row, offs, mask=ok)


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int, one_program_max: int = ONE_PROGRAM_MAX_PAIRS
) -> ExpertGroups:
    """Group the pairs of ``ids`` ([tokens, top_k] expert ids) by expert (see the module docstring)."""
    num_pairs = ids.numel()
    rows = max_grouped_rows(num_pairs, num_experts, block_m)
    dev = ids.device
    sorted_pairs = torch.empty(max(rows, 1), dtype=torch.int32, device=dev)
    block_experts = torch.empty(max(triton.cdiv(rows, block_m), 1), dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)  # the kernels write it (no memset in the graphs)
    groups = ExpertGroups(sorted_pairs, block_experts, num_rows, block_m)
    if num_pairs == 0:
        num_rows.zero_()
        return groups
    flat = ids.reshape(-1).to(torch.int32)  # tl.histogram counts 32-bit integers only
    e_pow2 = triton.next_power_of_2(num_experts + 1)  # one spare bin for masked lanes
    if num_pairs <= one_program_max:
        cursor = torch.empty(e_pow2, dtype=torch.int32, device=dev)
        pdl = use_pdl(ids)
        _group_one_program_kernel[(1,)](
            flat,
            sorted_pairs,
            block_experts,
            num_rows,
            cursor,
            num_pairs,
            num_experts,
            E_POW2=e_pow2,
            BLOCK_P=ONE_PROGRAM_BLOCK,
            BLOCK_M=block_m,
            USE_PDL=pdl,
            num_warps=8,
            launch_pdl=pdl,
        )
        return groups
    chunk = min(CHUNK_PAIRS, triton.next_power_of_2(one_program_max))
    num_chunks = triton.cdiv(num_pairs, chunk)
    cursors = torch.empty(num_chunks, e_pow2, dtype=torch.int32, device=dev)
    _count_chunks_kernel[(num_chunks,)](flat, cursors, num_pairs, num_experts, E_POW2=e_pow2, CHUNK=chunk)
    _chunk_offsets_kernel[(1,)](
        cursors,
        sorted_pairs,
        block_experts,
        num_rows,
        num_chunks,
        num_pairs,
        num_experts,
        E_POW2=e_pow2,
        BLOCK_M=block_m,
    )
    _scatter_chunks_kernel[(num_chunks,)](flat, cursors, sorted_pairs, num_pairs, E_POW2=e_pow2, CHUNK=chunk)
    return groups
