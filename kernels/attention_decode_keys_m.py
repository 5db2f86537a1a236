"""The split decode with the keys as the dots' M: scores^T = K q^T and O^T = V^T P^T, so a query group of up to 8
heads fills the dots' N of 8 (Triton's least for 16-bit dots) instead of being padded to 16 rows as M. Per key
that halves the MMAs and the softmax's values. Same arguments and results as ``_decode_split_kernel``."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention_store import decode_k_tile, decode_split, dot_operand, load_keys_contiguous
from kernels.pdl import pdl_enter


@triton.jit(do_not_specialize=["stride_os", "stride_lb", "stride_lh", "stride_bt", "num_splits"])
def _decode_split_keys_m_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt,
    num_splits,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to >= 8: the dots' N
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    DOT_F16: tl.constexpr,
    V_KEYS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b, kv_head, split, split_start, split_end = decode_split(seq_lens_ptr, num_splits, BLOCK_N, HEADS_FIRST)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    b64 = b.to(tl.int64)
    pdl_enter(USE_PDL)
    q_ptrs = q_ptr + b64 * stride_qb + heads[None, :] * stride_qh + offs_d[:, None]
    q_t = dot_operand(tl.load(q_ptrs, mask=mask_d[:, None] & mask_h[None, :], other=0.0), DOT_F16)  # [D, H]

    bt_row = block_tables_ptr + b64 * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kc_h
    if V_KEYS:
        v_base = v_cache_ptr + kv_head * stride_vc_h + offs_d[:, None] * PAGE
    else:
        v_base = v_cache_ptr + kv_head * stride_vc_h + offs_d[:, None]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)  # O^T

    for start_n in range(split_start, split_end, BLOCK_N):
        k, v_off, mask_n = decode_k_tile(
            bt_row, start_n, split_end, k_head, offs_d, mask_d, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
            BLOCK_N, PAGE,
        )  # fmt: skip
        if V_KEYS:
            v_t = load_keys_contiguous(v_base, v_off, mask_d)  # [D, keys]
        else:
            v_t = tl.load(v_base + v_off[None, :], mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        s_t = tl.dot(k.to(q_t.dtype), q_t) * qk_scale  # [keys, H]
        s_t = tl.where(mask_n[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        p_t = tl.exp2(s_t - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p_t, 0)
        acc = acc * alpha[None, :] + tl.dot(v_t.to(q_t.dtype), p_t.to(q_t.dtype))
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[None, :] * v_scale
    o_mask = mask_d[:, None] & mask_h[None, :]
    if DIRECT_OUT:
        o_ptrs = out_ptr + b64 * stride_ob + heads[None, :] * stride_oh + offs_d[:, None]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        o_ptrs = out_ptr + b64 * stride_ob + heads[None, :] * stride_oh + split * stride_os + offs_d[:, None]
        tl.store(o_ptrs, acc, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b64 * stride_lb + heads * stride_lh + split, lse, mask=mask_h)
