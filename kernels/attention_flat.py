"""Whole-step attention: one launch for every row of a step (prefill chunks, verify rows and decode rows alike, each
a sequence of 1 or more queries), whose grid does not depend on the step's layout, so a CUDA graph can hold it.

The eager path launches a prefill kernel sized by the longest chunk and a split-K decode kernel sized by the batch
for every layer: ~3 host launches a layer, which made an 8B model's mixed step host-bound (12.3 ms to launch on an
H100). Here a fixed number of persistent programs walk the step's work items, read from the device: an item is a
tile of ``BLOCK_Q`` tokens of one sequence times the ``GROUP`` query heads of one kv head (packed as the tile's
rows, so each K/V tile is loaded once per kv head, and a decode row fills GROUP rows of the tile, not one). A
sequence's tiles start at tile ``cu[s] // BLOCK_Q + s``: increasing in ``s``, so a program finds its sequence
by binary search. ``work`` holds (items, sequences), written by the host with the layout.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.attention_prefill import attend_keys
from kernels.attention_store import check_cache, dot_dtype_f16, dot_operand, kernel_scales, page_strides
from kernels.pdl import pdl_enter, use_pdl

BLOCK_ROWS = 64  # rows of a tile: BLOCK_Q tokens x the group's heads (padded to a power of two)


@triton.jit(do_not_specialize=["stride_bt"])
def _whole_step_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_ptr,  # [num_seqs + 1] int32 query offsets
    seq_lens_ptr,  # [num_seqs] int32 context lengths, this step's tokens included
    block_tables_ptr,
    work_ptr,  # int32 (work items, sequences)
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    k_strides,
    v_strides,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # ceil(log2(most sequences)) + 1
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F16: tl.constexpr,
    V_KEYS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P2
    pdl_enter(USE_PDL)
    num_items = tl.load(work_ptr)
    num_seqs = tl.load(work_ptr + 1)
    rows = tl.arange(0, BLOCK_M)
    tok, head_in_group = rows // GROUP_P2, rows % GROUP_P2
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        kv_head = item % NUM_KV_HEADS
        tile = item // NUM_KV_HEADS
        lo = tile * 0  # the last sequence whose first tile is at or before this one, in [lo, hi)
        hi = num_seqs
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            at_or_before = tl.load(cu_ptr + mid) // BLOCK_Q + mid <= tile
            narrowing = hi - lo > 1
            lo = tl.where(narrowing & at_or_before, mid, lo)
            hi = tl.where(narrowing & ~at_or_before, mid, hi)
        seq = lo
        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
        first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # the tile's first query within its sequence
        if first < q_len:  # a sequence's last tile slot may be empty
            kv_len = tl.load(seq_lens_ptr + seq)
            prefix = kv_len - q_len
            t = first + tok
            mask_m = (t < q_len) & (head_in_group < GROUP)
            head = kv_head * GROUP + head_in_group
            q_rows = (q_start + t).to(tl.int64)
            q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
            q = dot_operand(tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0), DOT_F16)
            bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
            acc, l_i = attend_keys(
                q, prefix + t, k_cache_ptr, v_cache_ptr, bt_row, kv_head, kv_len, prefix + first,
                prefix + first + BLOCK_Q, qk_scale, k_strides, v_strides, PAGE, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                V_KEYS,
            )  # fmt: skip
            acc = acc / l_i[:, None] * v_scale
            o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def group_padded(num_heads: int, num_kv_heads: int) -> int:
    return triton.next_power_of_2(num_heads // num_kv_heads)


def tile_tokens(num_heads: int, num_kv_heads: int, block_rows: int = BLOCK_ROWS) -> int:
    """Tokens of a tile (``BLOCK_Q``); the host's work count and the kernel's search must agree on it."""
    return max(1, block_rows // group_padded(num_heads, num_kv_heads))


def work_layout(
    q_lens: np.ndarray, num_heads: int, num_kv_heads: int, block_rows: int = BLOCK_ROWS
) -> tuple[np.ndarray, int]:
    """``cu`` (int32 query offsets) and the number of work items of a step whose sequences take ``q_lens`` queries
    (in tiles of ``block_rows`` rows: the kernel's must be the same)."""
    cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    tiles = int(cu[-1]) // tile_tokens(num_heads, num_kv_heads, block_rows) + len(q_lens)  # the last tile slot's end
    return cu, tiles * num_kv_heads


def whole_step_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    work: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_seqs: int,
    num_programs: int,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of every row of ``q`` (rows past ``cu[num_seqs]`` are left as they are) into ``out``; ``work``:
    int32 (items, sequences) from ``work_layout``; ``max_seqs``: the most sequences a replay may bring; ``tiles``:
    (rows, keys, warps, stages) a tile, the rows as ``work_layout`` was given them (benchmarks/whole_step_sweep.py)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    v_keys = check_cache(k_cache, v_cache)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and block_tables.stride(-1) == 1
    group_p2 = group_padded(num_heads, num_kv_heads)
    pdl = use_pdl(q)
    block_rows, block_n, num_warps, num_stages = tiles or (BLOCK_ROWS, 64 if head_dim <= 128 else 32, 4, 2)
    _whole_step_kernel[(num_programs,)](
        q,
        k_cache,
        v_cache,
        out,
        cu,
        seq_lens,
        block_tables,
        work,
        *kernel_scales(k_cache, scale, 1.0, 1.0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *page_strides(k_cache, v_cache),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        GROUP_P2=group_p2,
        SEARCH_STEPS=max(1, max_seqs).bit_length() + 1,
        PAGE=page,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=max(block_rows, group_p2),
        BLOCK_N=block_n,
        DOT_F16=dot_dtype_f16(q, k_cache),
        V_KEYS=v_keys,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    return out
