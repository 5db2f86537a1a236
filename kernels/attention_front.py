"""The decode front inside the split decode kernel: each program finishes its query heads itself (per-head RMSNorm,
neox RoPE) from the raw q/k/v projection, and the program whose split holds the sequence's newest position also
finishes that token's K, writes K and V into the paged cache and attends to it from registers.

This is ``fused.qk_norm_rope_`` with its ``KVStore`` moved into the attention launch: a decode step loses one
launch per layer, and the wait on it in the chain of short kernels. The arithmetic per element is that kernel's
(the same roundings to the model's dtype), so the two paths agree up to the order of float32 sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.attention import is_fp8
from kernels.attention_store import fp8_cache_value


class DecodeFront(NamedTuple):
    """The raw operands of the fused front, one row per decode sequence: its position and KV slot (-1: nothing
    written), the raw K rows [B, kv heads, head_dim] (a view of the qkv projection is fine) and the V rows, the
    norms' weights (None: RoPE only, for families without q/k norms) and epsilon, and the rotary cos|sin table."""

    positions: torch.Tensor
    slots: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    cos_sin: torch.Tensor


def front_args(
    front: DecodeFront | None, q: torch.Tensor, k_cache: torch.Tensor, k_scale: float, v_scale: float
) -> tuple[tuple, dict]:
    """The split kernel's front arguments and constexprs (placeholders when ``front`` is None)."""
    if front is None:
        return (q, q, q, q, q, q, q, 0, 0, 0, 0, 0, 0.0, 1.0, 1.0), dict(FRONT=False, HAS_NORM=False, KV_FP8=False)
    k, v, has_norm = front.k, front.v, front.q_weight is not None
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.shape == v.shape and k.shape[0] == q.shape[0]
    args = (
        front.positions,
        front.slots,
        k,
        v,
        front.q_weight if has_norm else q,
        front.k_weight if has_norm else q,
        front.cos_sin,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        front.cos_sin.stride(0),
        front.eps,
        1.0 / k_scale,
        1.0 / v_scale,
    )
    return args, dict(FRONT=True, HAS_NORM=has_norm, KV_FP8=is_fp8(k_cache))


@triton.jit
def normed_roped(rows, rows_mask, offs_d, w_ptr, cs_row, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """[R, BLOCK_D] of the head rows at pointers ``rows`` [R]: RMSNorm with weight ``w_ptr`` (HAS_NORM), then neox
    RoPE with the cos|sin row ``cs_row``, in the rows' dtype; masked rows and columns are zero."""
    half: tl.constexpr = HEAD_DIM // 2
    mask = rows_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    first = offs_d < half
    partner = tl.where(first, offs_d + half, offs_d - half)  # the other element of each rotary pair
    x = tl.load(rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(rows[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    dt = rows.dtype.element_ty
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        w = tl.load(w_ptr + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        x = ((x * rstd[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt).to(tl.float32)
        xp = ((xp * rstd[:, None]).to(dt).to(tl.float32) * wp[None, :]).to(dt).to(tl.float32)
    rot = offs_d % half
    cos = tl.load(cs_row + rot, mask=offs_d < HEAD_DIM, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(cs_row + half + rot, mask=offs_d < HEAD_DIM, other=0.0).to(dt).to(tl.float32)
    sign = tl.where(first, -1.0, 1.0)
    return (x * cos[None, :] + sign[None, :] * xp * sin[None, :]).to(dt)


@triton.jit
def newest_key_state(
    q,
    newest,
    k_row,
    v_row,
    slot_ptr,
    wk_ptr,
    cs_row,
    k_head,
    v_head,
    stride_kc_b,
    stride_kc_s,
    stride_vc_b,
    stride_vc_s,
    offs_d,
    qk_scale,
    eps,
    inv_k_scale,
    inv_v_scale,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """The online softmax's starting state (running max, sum, accumulator) of the query group ``q``: in the program
    whose split holds the newest position (``newest``, a [1] bool), the state after that one key, which it also
    finishes and writes into the cache at its slot; elsewhere the empty state. Taken before the loop over the
    cached keys (the softmax is order-free), its tiles are dead by the loop: a step after it held ~100 registers
    more through the whole kernel."""
    one = tl.arange(0, 1)
    k = normed_roped(k_row + one, newest, offs_d, wk_ptr, cs_row, eps, HEAD_DIM, HAS_NORM)  # [1, BLOCK_D]
    d_mask = newest[:, None] & (offs_d < HEAD_DIM)[None, :]
    v = tl.load(v_row + one[:, None] + offs_d[None, :], mask=d_mask)
    if KV_FP8:
        k, v = fp8_cache_value(k, inv_k_scale), fp8_cache_value(v, inv_v_scale)
    k = k.to(k_head.dtype.element_ty)  # the values the cache holds, as later steps will read them
    v = v.to(v_head.dtype.element_ty)
    slot = tl.load(slot_ptr + one, mask=newest, other=-1).to(tl.int64)
    store = d_mask & (slot >= 0)[:, None]
    page, in_page = slot // PAGE, slot % PAGE
    kc = k_head + page * stride_kc_b + in_page * stride_kc_s
    vc = v_head + page * stride_vc_b + in_page * stride_vc_s
    tl.store(kc[:, None] + offs_d[None, :], k, mask=store)
    tl.store(vc[:, None] + offs_d[None, :], v, mask=store)
    # the loop's dot in q's dtype, here as float32 products of the same operands; the key's own weight is 1
    s = tl.sum(q.to(tl.float32) * k.to(q.dtype).to(tl.float32), axis=1) * qk_scale
    m_i = tl.where(newest, s, float("-inf"))
    l_i = tl.where(newest, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.where(d_mask, v.to(q.dtype).to(tl.float32), 0.0) + tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    return m_i, l_i, acc
