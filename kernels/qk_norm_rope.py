"""Per-head q/k RMSNorm (where the family has it) and RoPE, in place on the qkv projection's output, in one launch
that also writes the token's K/V into the paged cache (``KVStore``); e4m3 caches store K and V divided by their
scales. Rounding follows HF's Qwen3 (the oracle): the norm runs in float32 and is rounded to the model dtype before
it is scaled by the weight; RoPE uses the rounded normed values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.attention import is_fp8
from kernels.attention_store import check_cache, fp8_cache_value, page_strides, slot_offset
from kernels.pdl import pdl_enter, use_pdl

# from this many tokens (prefill), programs of 8 heads (q/k, or v): one program of a Qwen3-8B token's 40 heads let
# 3 programs onto an SM (W1 FP8 +0.75% with 8-head programs, log 37c); decode rows keep one program a token (one
# row of W2 FP8 ran 1.8% slower in 8-head programs)
_SMALL_BLOCKS_FROM = 512
_BLOCK_H = 8


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,
    wq_ptr,
    wk_ptr,
    cos_sin_ptr,
    pos_ptr,
    v_ptr,  # the KV store's operands; unused unless STORE_KV
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    xs_ptr,  # SCALED: x and v are an FP8 qkv product before its scales, per token and per channel; else unused
    ws_ptr,
    stride_xt,
    stride_xh,
    stride_cs,
    stride_vt,
    stride_vh,
    k_strides,  # page_strides; V's head_dim stride is 1, or the page size when V is stored keys-contiguous
    v_strides,
    eps,
    inv_k_scale,  # an e4m3 cache's 1 / k_scale and 1 / v_scale (unused for 16-bit caches)
    inv_v_scale,
    PAGE: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,  # q/k heads a program takes
    BLOCK_V: tl.constexpr,  # v heads a program takes
    V_INLINE: tl.constexpr,  # one q/k program a token (BLOCK_H covers all heads), which also stores the V rows
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    KV_FP8: tl.constexpr,
    SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # A program per token and block of BLOCK_H heads: its q and k heads as rows of one tile (q rows take q_norm's
    # weight, k rows k_norm's), each row split in its two rotary halves, written back in place; with STORE_KV the
    # finished K rows also go to the paged cache at the token's slot (slot -1: padding, nothing written), and the
    # token's V rows too: by the blocks past the q/k heads, or by the one q/k program (V_INLINE). Many tokens take
    # small tiles, which keep many programs resident per SM (one program of all 40 heads of a Qwen3-8B token held
    # the SM's registers alone); their slot is read with the rows, not behind the stores. One wait, for every
    # program, at the top level (tests/kernels/test_pdl_rule.py).
    t = tl.program_id(0).to(tl.int64)
    QK_BLOCKS: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    NUM_KV: tl.constexpr = NUM_HEADS - NUM_Q_HEADS  # the v heads, as many as the k heads
    block = tl.program_id(1)
    # before the wait: the step's positions, the rotary table and the norm weights, which no kernel writes (a
    # program of v heads has no q/k rows: its h are past NUM_HEADS, all masked)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = block * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hmask = (h[:, None] < NUM_HEADS) & (d[None, :] < HALF)
    dt = x_ptr.dtype.element_ty
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d).to(dt).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d).to(dt).to(tl.float32)
    if HAS_NORM:
        is_q = (h < NUM_Q_HEADS)[:, None]
        w1 = tl.where(is_q, tl.load(wq_ptr + d)[None, :], tl.load(wk_ptr + d)[None, :]).to(tl.float32)
        w2 = tl.where(is_q, tl.load(wq_ptr + HALF + d)[None, :], tl.load(wk_ptr + HALF + d)[None, :]).to(tl.float32)
    if SCALED:  # the qkv channels in order: q and k heads, then the v heads
        ws1 = tl.load(ws_ptr + h[:, None] * (2 * HALF) + d[None, :], mask=hmask, other=0.0)
        ws2 = tl.load(ws_ptr + h[:, None] * (2 * HALF) + HALF + d[None, :], mask=hmask, other=0.0)
    pdl_enter(USE_PDL)
    if STORE_KV and not V_INLINE:  # issued with the rows' loads, not behind the stores
        slot = tl.load(slot_ptr + t).to(tl.int64)
    if block < QK_BLOCKS:
        base = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
        x1 = tl.load(base, mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=hmask, other=0.0).to(tl.float32)
        if SCALED:  # kernels/fp8_rescale.py's arithmetic and rounding
            xs = tl.load(xs_ptr + t)
            x1 = (x1 * (xs * ws1)).to(dt).to(tl.float32)
            x2 = (x2 * (xs * ws2)).to(dt).to(tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
            n1 = ((x1 * rstd[:, None]).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            n2 = ((x2 * rstd[:, None]).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        else:
            n1, n2 = x1, x2
        o1 = (n1 * cos[None, :] - n2 * sin[None, :]).to(dt)
        o2 = (n2 * cos[None, :] + n1 * sin[None, :]).to(dt)
        tl.store(base, o1, mask=hmask)
        tl.store(base + HALF, o2, mask=hmask)
        if STORE_KV:
            if V_INLINE:  # the one program of a token reads the rest last: fewer registers held, more programs an SM
                slot = tl.load(slot_ptr + t).to(tl.int64)
            page, in_page = slot // PAGE, slot % PAGE
            # compared as a tensor: the interpreter mis-types a scalar bool broadcast into a mask
            kmask = hmask & (h[:, None] >= NUM_Q_HEADS) & ((slot + 0 * h) >= 0)[:, None]
            kc = k_cache_ptr + slot_offset(k_strides, page, in_page) + (h[:, None] - NUM_Q_HEADS) * k_strides[2]
            kc += d[None, :]
            k1, k2 = o1, o2
            if KV_FP8:
                k1, k2 = fp8_cache_value(o1, inv_k_scale), fp8_cache_value(o2, inv_k_scale)
            tl.store(kc, k1.to(k_cache_ptr.dtype.element_ty), mask=kmask)
            tl.store(kc + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kmask)
            if V_INLINE:
                _store_v(t, 0, slot, v_ptr, xs_ptr, ws_ptr, v_cache_ptr, stride_vt, stride_vh, v_strides,
                         inv_v_scale, PAGE, NUM_HEADS, NUM_KV, HALF, BLOCK_V, SCALED, KV_FP8)  # fmt: skip
    elif STORE_KV and not V_INLINE:  # the V rows of a block of heads
        _store_v(t, (block - QK_BLOCKS) * BLOCK_V, slot, v_ptr, xs_ptr, ws_ptr, v_cache_ptr, stride_vt, stride_vh,
                 v_strides, inv_v_scale, PAGE, NUM_HEADS, NUM_KV, HALF, BLOCK_V, SCALED, KV_FP8)  # fmt: skip


@triton.jit
def _store_v(
    t, first, slot, v_ptr, xs_ptr, ws_ptr, v_cache_ptr, stride_vt, stride_vh, v_strides, inv_v_scale,
    PAGE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr,
    HALF: tl.constexpr, BLOCK_V: tl.constexpr, SCALED: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s V rows of heads ``first`` to ``first + BLOCK_V`` into the cache at ``slot`` (-1: none)."""
    kv = first + tl.arange(0, BLOCK_V)
    dd = tl.arange(0, 2 * HALF)
    # compared as a tensor: the interpreter mis-types a scalar bool broadcast into a mask
    vmask = (kv[:, None] < NUM_KV) & ((slot + 0 * kv) >= 0)[:, None] & (dd[None, :] < 2 * HALF)
    v = tl.load(v_ptr + t * stride_vt + kv[:, None] * stride_vh + dd[None, :], mask=vmask)
    if SCALED:
        wsv = tl.load(ws_ptr + (NUM_HEADS + kv[:, None]) * (2 * HALF) + dd[None, :], mask=vmask, other=0.0)
        v = (v.to(tl.float32) * (tl.load(xs_ptr + t) * wsv)).to(v_ptr.dtype.element_ty)
    if KV_FP8:
        v = fp8_cache_value(v, inv_v_scale)
    page, in_page = slot // PAGE, slot % PAGE
    dst = v_cache_ptr + slot_offset(v_strides, page, in_page) + kv[:, None] * v_strides[2] + dd[None, :] * v_strides[3]
    tl.store(dst, v.to(v_cache_ptr.dtype.element_ty), mask=vmask)


class KVStore(NamedTuple):
    """Where qk_norm_rope_ also writes the token's K/V: the new V rows [tokens, kv heads, head_dim], the paged
    caches [num_blocks, block_size, kv heads, head_dim] and each token's slot (-1: not written); an e4m3 cache
    stores K / k_scale and V / v_scale (kernels/attention.py)."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


def qk_norm_rope_(
    qk: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    num_q_heads: int,
    kv_store: KVStore | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """In place: per-head RMSNorm then neox RoPE of ``qk`` [tokens, q heads + k heads, head_dim] (a strided view
    of the qkv projection is fine): q heads with ``q_weight``, the rest with ``k_weight`` (both None: RoPE only,
    for families without q/k norms). One launch for both, which with ``kv_store`` also writes the finished K and
    the V rows into the paged KV cache. ``scales`` (per token [tokens], per qkv channel): ``qk`` and the V rows
    are an FP8 product before its scales (kernels/fp8_rescale.py ``Unscaled``), applied here as the rescale would."""
    tokens, heads, head_dim = qk.shape
    assert qk.stride(-1) == 1
    assert scales is None or (kv_store is not None and scales[1].numel() == (heads + kv_store.v.shape[1]) * head_dim)
    if tokens == 0:
        return qk
    pdl = use_pdl(qk)
    num_kv = heads - num_q_heads
    kv_fp8, inv_scales = False, (1.0, 1.0)
    if kv_store is not None:
        v, k_cache, v_cache, slots, k_scale, v_scale = kv_store
        kv_fp8, inv_scales = is_fp8(k_cache), (1.0 / k_scale, 1.0 / v_scale)
        assert v.shape == (tokens, num_kv, head_dim) and v.stride(-1) == 1
        check_cache(k_cache, v_cache)
        store_args = (v, k_cache, v_cache, slots, v.stride(0), v.stride(1), *page_strides(k_cache, v_cache))
        page = k_cache.shape[1]
    else:
        store_args, page = (qk, qk, qk, positions, 0, 0, (0,) * 4, (0,) * 4), 1  # placeholders: V's rows, caches
    has_norm = q_weight is not None
    small_blocks = tokens >= _SMALL_BLOCKS_FROM
    block_h, block_v = (
        (_BLOCK_H, _BLOCK_H) if small_blocks else (triton.next_power_of_2(heads), triton.next_power_of_2(num_kv))
    )
    v_blocks = triton.cdiv(num_kv, block_v) if kv_store is not None and small_blocks else 0
    blocks = triton.cdiv(heads, block_h) + v_blocks
    _qk_norm_rope_kernel[(tokens, blocks)](
        qk,
        q_weight if has_norm else qk,
        k_weight if has_norm else qk,
        cos_sin,
        positions,
        *store_args[:4],
        *(scales if scales is not None else (cos_sin, cos_sin)),
        qk.stride(0),
        qk.stride(1),
        cos_sin.stride(0),
        *store_args[4:],
        eps,
        *inv_scales,
        PAGE=page,
        NUM_Q_HEADS=num_q_heads,
        NUM_HEADS=heads,
        HALF=head_dim // 2,
        BLOCK_H=block_h,
        BLOCK_V=block_v,
        V_INLINE=not small_blocks,
        HAS_NORM=has_norm,
        STORE_KV=kv_store is not None,
        KV_FP8=kv_fp8,
        SCALED=scales is not None,
        USE_PDL=pdl,
        num_warps=2 if small_blocks else (4 if heads <= 32 else 8),
        launch_pdl=pdl,
    )
    return qk
