"""Triton variable-length prefill ("extend") kernel for paged attention: causal attention of each prefill chunk
over its cached prefix and itself. The backend (:mod:`kernels.triton_attention`) launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention_store import dot_operand, exact_dot, load_keys_contiguous, slot_offset, softmax_tile
from kernels.pdl import pdl_enter


# Integers that change from step to step (block-table width, split count, their strides) are not specialized:
# Triton would otherwise compile a new variant (~0.5 s) the first time one is 1 or a multiple of 16, mid-run.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,  # softmax scale * log2(e) (* k_scale): the softmax runs in base 2
    v_scale,  # an FP8 cache's V scale (1.0 for 16-bit caches)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    k_strides,  # page_strides
    v_strides,
    stride_bt,
    GROUP: tl.constexpr,  # q heads per kv head
    PAGE: tl.constexpr,  # cache block size
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F16: tl.constexpr,  # dot_dtype_f16
    V_KEYS: tl.constexpr,  # V stored keys-contiguous (kernels/attention.py value_cache): read as [D, keys] tiles
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # Query blocks are visited last-first: under the causal mask they are the longest, so they start early
    # and the short ones fill the tail. The grid is sized by max_seqlen_q; extra programs exit at once.
    pid_m = tl.cdiv(q_len, BLOCK_M) - 1 - tl.program_id(0)
    if pid_m >= 0:
        kv_len = tl.load(seq_lens_ptr + seq)
        prefix = kv_len - q_len  # position of query 0 (cached prefix length)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        q_pos = prefix + offs_m

        q_rows = (q_start + offs_m).to(tl.int64)
        q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = dot_operand(tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0), DOT_F16)

        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        first_pos = prefix + pid_m * BLOCK_M
        acc, l_i = attend_keys(
            q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, kv_len, first_pos, first_pos + BLOCK_M, qk_scale,
            k_strides, v_strides, PAGE, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, V_KEYS,
        )  # fmt: skip
        acc = acc / l_i[:, None] * v_scale
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def attend_keys(
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_head,
    kv_len,
    first_pos,
    last_pos_end,
    qk_scale,
    k_strides,
    v_strides,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_KEYS: tl.constexpr,
):
    """Causal attention of a [BLOCK_M, D] query tile ``q`` (rows at positions ``q_pos``, the earliest
    ``first_pos``, all below ``last_pos_end``) over its sequence's cached keys (block-table row ``bt_row``, kv head
    ``kv_head``, ``kv_len`` keys); returns the unnormalized accumulator and the softmax sums."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    k_base = k_cache_ptr + kv_head * k_strides[2] + offs_d[None, :]
    if V_KEYS:
        v_base = v_cache_ptr + kv_head * v_strides[2] + offs_d[:, None] * PAGE
    else:
        v_base = v_cache_ptr + kv_head * v_strides[2] + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys below `full_end` are visible to every query of this tile (no mask needed); keys in [full_end, kv_end)
    # straddle the causal diagonal. Key 0 is in the first tile either way, so every row has a finite running max
    # after one iteration and fully-masked tiles never yield NaN.
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(kv_len, last_pos_end)

    for start_n in range(0, full_end, BLOCK_N):
        pos_n = start_n + offs_n
        page = tl.load(bt_row + pos_n // PAGE).to(tl.int64)
        in_page = (pos_n % PAGE).to(tl.int64)
        k = tl.load(k_base + slot_offset(k_strides, page, in_page)[:, None], mask=mask_d[None, :], other=0.0)
        v_off = slot_offset(v_strides, page, in_page)  # V's slot stride is 1 when V_KEYS
        if V_KEYS:
            v = tl.trans(load_keys_contiguous(v_base, v_off, mask_d))
        else:
            v = tl.load(v_base + v_off[:, None], mask=mask_d[None, :], other=0.0)
        qk = exact_dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        m_i, l_i, acc = softmax_tile(q, qk, v, m_i, l_i, acc)

    for start_n in range(full_end, kv_end, BLOCK_N):
        pos_n = start_n + offs_n
        # Never touch block-table entries past kv_len's page, or (but V_KEYS's) slots at or past kv_len: they
        # may be garbage.
        mask_n = pos_n < kv_len
        page = tl.load(bt_row + pos_n // PAGE, mask=pos_n // PAGE < tl.cdiv(kv_len, PAGE), other=0).to(tl.int64)
        in_page = (pos_n % PAGE).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + slot_offset(k_strides, page, in_page)[:, None], mask=kv_mask, other=0.0)
        v_off = slot_offset(v_strides, page, in_page)  # V's slot stride is 1 when V_KEYS
        if V_KEYS:
            v = tl.trans(load_keys_contiguous(v_base, v_off, mask_d))
        else:
            v = tl.load(v_base + v_off[:, None], mask=kv_mask, other=0.0)
        qk = exact_dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        causal = (pos_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        m_i, l_i, acc = softmax_tile(q, qk, v, m_i, l_i, acc)
    return acc, l_i
