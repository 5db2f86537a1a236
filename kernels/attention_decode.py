"""Triton split-K decode kernels for paged attention: one query per sequence, the context split over programs
(stage 1, partial attention per split) and the splits' results merged (stage 2), and ``split_decode``, which
launches them. The backend (:mod:`kernels.triton_attention`) picks the split count (``num_decode_splits``) and the
tiles; the tiles pick stage 1's layout (``KEYS_M``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_store import (
    check_cache,
    decode_k_tile,
    decode_split,
    dot_dtype_f16,
    dot_operand,
    exact_dot,
    kernel_scales,
    load_keys_contiguous,
    page_strides,
    per_item,
    per_query,
    softmax_tile,
)
from kernels.pdl import pdl_enter, use_pdl

# The query group's least padding in each layout: 16 rows as the dots' M (Triton's least M for 16-bit dots), 8 as N.
_MIN_GROUP_ROWS, _MIN_GROUP_COLS = 16, 8


# Integers that change from step to step (block-table width, split count, their strides) are not specialized:
# Triton would otherwise compile a new variant (~0.5 s) the first time one is 1 or a multiple of 16, mid-run.
@triton.jit(do_not_specialize=["stride_os", "stride_lb", "stride_lh", "stride_bt", "num_splits"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,  # final output when DIRECT_OUT, else the partial accumulators [B, Hq, num_splits, D] fp32
    lse_ptr,  # [B, Hq, num_splits] fp32, base-2 log-sum-exp of each split (unused when DIRECT_OUT)
    qk_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    k_strides,  # page_strides
    v_strides,
    stride_bt,
    num_splits,  # runtime int: a new split count does not recompile
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to the least the dots take in its place (_MIN_GROUP_ROWS / _COLS)
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # single split: normalise and write the final output, no merge pass
    HEADS_FIRST: tl.constexpr,  # grid (kv heads, splits, batch): a sequence's heads run side by side
    DOT_F16: tl.constexpr,  # dot_dtype_f16
    V_KEYS: tl.constexpr,  # V stored keys-contiguous (kernels/attention.py value_cache): read as [D, keys] tiles
    # The keys as the dots' M and the query group as N: scores^T = K q^T, O^T = V^T P^T, every tile transposed
    # (q [D, H], scores [keys, H], V [D, keys], O [D, H]). A group of up to 8 heads then fills N's least of 8 instead
    # of being padded to 16 rows as M: per key half the MMAs and the softmax's values (softmax_tile).
    KEYS_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b, kv_head, split, split_start, split_end = decode_split(seq_lens_ptr, num_splits, BLOCK_N, HEADS_FIRST)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    b64 = b.to(tl.int64)
    pdl_enter(USE_PDL)  # q and the newest token's K/V come from the kernel in front
    q_ptrs = q_ptr + b64 * stride_qb + per_query(heads, KEYS_M) * stride_qh + per_item(offs_d, KEYS_M)
    q_mask = per_query(mask_h, KEYS_M) & per_item(mask_d, KEYS_M)  # [H, D], or [D, H] with KEYS_M
    q = dot_operand(tl.load(q_ptrs, mask=q_mask, other=0.0), DOT_F16)

    bt_row = block_tables_ptr + b64 * stride_bt
    k_head = k_cache_ptr + kv_head * k_strides[2]
    if V_KEYS:
        v_base = v_cache_ptr + kv_head * v_strides[2] + offs_d[:, None] * PAGE
    else:
        v_base = v_cache_ptr + kv_head * v_strides[2] + per_item(offs_d, KEYS_M)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if KEYS_M:
        acc = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    # Every tile starts below split_end, so it holds at least one valid key: the running max is finite
    # from the first iteration on (padded head rows have q = 0, hence finite scores too).
    for start_n in range(split_start, split_end, BLOCK_N):
        k, v_off, mask_n = decode_k_tile(
            bt_row, start_n, split_end, k_head, offs_d, mask_d, k_strides, v_strides, BLOCK_N, PAGE
        )
        if V_KEYS:
            v = load_keys_contiguous(v_base, v_off, mask_d)  # [D, keys]: K-major for the P.V dot either way
            if not KEYS_M:
                v = tl.trans(v)
        else:  # V's keys in the queries' place: [keys, D], or [D, keys] with KEYS_M
            v_mask = per_query(mask_n, KEYS_M) & per_item(mask_d, KEYS_M)
            v = tl.load(v_base + per_query(v_off, KEYS_M), mask=v_mask, other=0.0)
        if KEYS_M:
            qk = exact_dot(k.to(q.dtype), q) * qk_scale  # [keys, H]
        else:
            qk = exact_dot(q, tl.trans(k.to(q.dtype))) * qk_scale  # [H, keys]
        qk = tl.where(per_item(mask_n, KEYS_M), qk, float("-inf"))
        m_i, l_i, acc = softmax_tile(q, qk, v, m_i, l_i, acc, KEYS_M)

    # Empty split (or seq_len == 0): l_i = 0, acc = 0 -> writes zeros and lse = -inf, which the merge ignores.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / per_query(l_safe, KEYS_M) * v_scale
    o_ptrs = out_ptr + b64 * stride_ob + per_query(heads, KEYS_M) * stride_oh + per_item(offs_d, KEYS_M)
    o_mask = per_query(mask_h, KEYS_M) & per_item(mask_d, KEYS_M)
    if DIRECT_OUT:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs + split * stride_os, acc, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b64 * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_lb", "stride_lh", "num_splits"])
def _decode_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr,  # query heads a program merges
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = heads < num_heads
    mask_hs = mask_h[:, None] & (offs_s < num_splits)[None, :]
    mask_d = offs_d < HEAD_DIM

    lse_ptrs = lse_ptr + b * stride_lb + heads[:, None] * stride_lh + offs_s[None, :]
    lse = tl.load(lse_ptrs, mask=mask_hs, other=float("-inf"))  # [HEADS, BLOCK_S]
    m = tl.max(lse, 1)
    # All splits empty (seq_len == 0 padding row): shift by 0 so the weights are exp2(-inf) = 0, output 0.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])
    denom = tl.sum(w, 1)
    part_ptrs = part_ptr + b * stride_pb + heads[:, None, None] * stride_ph + offs_s[None, :, None] * stride_ps
    parts = tl.load(part_ptrs + offs_d[None, None, :], mask=mask_hs[:, :, None] & mask_d[None, None, :], other=0.0)
    o = tl.sum(parts * w[:, :, None], 1) / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


def merge_heads(num_heads: int, block_s: int) -> int:
    """Query heads a merge program takes: up to 32 splits' partials. 256 sequences over 4 splits launch 1,024
    programs, not 8,192 of 2 KB each (W1 FP8 + FP8 KV +0.4%); one sequence over 32 splits keeps a head a program."""
    return min(triton.next_power_of_2(num_heads), max(1, 32 // block_s))


def split_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    scales: tuple[float, float, float],
    num_splits: int,
    tiles: tuple[int, ...],
    heads_first: bool,
) -> None:
    """``out`` [B, Hq, D] = each row of ``q`` attending over its sequence's cached context: the split kernel over
    ``num_splits`` ranges of every context, then (several splits) the merge. ``scales``: the softmax scale, K's and
    V's cache scales; ``tiles``: keys per tile, warps, pipeline stages and optionally a register cap per thread
    (0: none); ``heads_first``: the grid's order. One-warp tiles take the keys as stage 1's M where the query group
    has up to 8 heads (-8 to -22% a layer over e4m3 at 16-256 sequences on an H200, log 35b); more warps keep the
    group as M (Triton builds the keys-as-M dots of 4 warps as wgmma with 132 KB of shared memory)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    v_keys = check_cache(k_cache, v_cache)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n, num_warps, num_stages, *cap = tiles
    caps = {"maxnreg": cap[0]} if cap and cap[0] and q.is_cuda else {}
    pdl = use_pdl(q)
    direct = num_splits == 1
    if direct:
        part, lse = out, out  # lse unused
        part_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        part = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_strides = part.stride()[:3]
        lse_strides = lse.stride()[:2]
    grid = (num_kv_heads, num_splits, batch) if heads_first else (batch, num_kv_heads, num_splits)
    group = num_heads // num_kv_heads
    keys_m = num_warps == 1 and group <= _MIN_GROUP_COLS
    _decode_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        seq_lens,
        block_tables,
        part,
        lse,
        *kernel_scales(k_cache, *scales),
        q.stride(0),
        q.stride(1),
        *part_strides,
        *lse_strides,
        *page_strides(k_cache, v_cache),
        block_tables.stride(0),
        num_splits,
        GROUP=group,
        PAGE=page,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(_MIN_GROUP_COLS if keys_m else _MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        DIRECT_OUT=direct,
        HEADS_FIRST=heads_first,
        DOT_F16=dot_dtype_f16(q, k_cache),
        V_KEYS=v_keys,
        KEYS_M=keys_m,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
        **caps,
    )
    if not direct:
        block_s = triton.next_power_of_2(num_splits)
        heads = merge_heads(num_heads, block_s)
        _decode_merge_kernel[(batch, triton.cdiv(num_heads, heads))](
            part,
            lse,
            out,
            *part_strides,
            *lse_strides,
            out.stride(0),
            out.stride(1),
            num_splits,
            num_heads,
            HEAD_DIM=head_dim,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
            HEADS=heads,
            USE_PDL=pdl,
            num_warps=4 if q.is_cuda else 1,
            launch_pdl=pdl,
        )
