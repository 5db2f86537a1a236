"""Triton KV store for paged attention: each token's K and V rows into the paged cache at its ``slot_mapping``
entry (slot -1 marks padding), and how an FP8 cache is written and read.

Layout and metadata are those of :mod:`kernels.attention`; ``TorchAttentionBackend`` is the oracle. The backend
(:mod:`kernels.triton_attention`) calls ``store_kvcache``.

An e4m3 (FP8) cache holds ``value / scale`` with one float scale for K and one for V (``k_scale``, ``v_scale``;
the model uses 1.0, as vLLM does without calibrated scales): the store kernel divides and saturates at 448, the
attention kernels read e4m3 tiles, widen them (and a bf16 query) to float16 for the dots, fold ``k_scale`` into the
softmax scale and apply ``v_scale`` to the output. A 16-bit cache ignores the scales. The attention kernels' shared
pieces live here too: the query as a dot operand, one tile of the online softmax, and the launch arguments every
attention kernel takes (the cache check, its page strides, the two scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import cache_scales, is_fp8, keys_contiguous
from kernels.pdl import pdl_enter, use_pdl

_LOG2E = 1.4426950408889634


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether V is stored keys-contiguous (``value_cache``). Kernels index K's last dim, and V's unless so, with
    unit stride; the other strides are passed through."""
    v_keys = keys_contiguous(v_cache)
    if k_cache.stride(-1) != 1 or not (v_cache.stride(-1) == 1 or v_keys):
        raise ValueError("KV cache must have a contiguous head_dim (or, for V, contiguous keys)")
    return v_keys


def kernel_scales(k_cache: torch.Tensor, scale: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The prefill and decode kernels' two scale arguments: q.k's (base-2 exponent, K's cache scale folded in), V's."""
    k_mult, v_mult = cache_scales(k_cache, k_scale, v_scale)
    return scale * _LOG2E * k_mult, v_mult


def page_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The KV-cache kernels' ``k_strides`` and ``v_strides``: each cache's (block, slot, head, head_dim) strides as
    one tuple argument. Triton specializes a tuple's elements as it does scalar arguments (value_cache's unit slot
    stride becomes a constant, the others get the 16-divisibility hint), so the kernels compile as they did with a
    parameter a stride: the same SASS at Triton 3.6 (tests/support/attention_sm90_build.py). Triton 3.6 does so even
    for a tuple named in ``do_not_specialize``: an integer that changes from step to step never goes in one."""
    return tuple(k_cache.stride()), tuple(v_cache.stride())


@triton.jit
def slot_offset(strides, page, in_page):
    """Where slot ``in_page`` of cache block ``page`` starts, in a cache of ``strides`` (``page_strides``)."""
    return page * strides[0] + in_page * strides[1]


# ----------------------------------------------------------------------------------------------------------------------
# store_kvcache
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def fp8_cache_value(x, inv_scale):
    """What an e4m3 cache stores for ``x``: ``x / scale``, saturated (e4m3fn has no infinity)."""
    return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    k_strides,  # page_strides; V's head_dim stride is 1, or the page size when V is stored keys-contiguous
    v_strides,
    inv_k_scale,
    inv_v_scale,
    PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    # One program per token, all kv heads at once: the token's K/V rows are a single small tile.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # slot -1 marks padding tokens: the mask turns the whole program into a no-op. Compared as a tensor
    # because the interpreter mis-types a scalar bool broadcast into a mask.
    valid = (slot + 0 * offs_h) >= 0
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & valid[:, None]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        k = fp8_cache_value(k, inv_k_scale)
        v = fp8_cache_value(v, inv_v_scale)
    block, in_page = slot // PAGE, slot % PAGE
    kc = k_cache_ptr + slot_offset(k_strides, block, in_page) + offs_h[:, None] * k_strides[2] + offs_d[None, :]
    vc = v_cache_ptr + slot_offset(v_strides, block, in_page) + offs_h[:, None] * v_strides[2]
    vc += offs_d[None, :] * v_strides[3]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Each token's K and V rows [tokens, kv heads, head_dim] into the paged caches at its slot (-1: not written)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_cache(k_cache, v_cache)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have a contiguous head_dim")
    pdl = use_pdl(k)
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *page_strides(k_cache, v_cache),
        1.0 / k_scale,
        1.0 / v_scale,
        PAGE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=is_fp8(k_cache),
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )


# ----------------------------------------------------------------------------------------------------------------------
# reading an e4m3 cache: the dtype of the attention kernels' dots
# ----------------------------------------------------------------------------------------------------------------------


def dot_dtype_f16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the dots run in float16: a bfloat16 query over an e4m3 cache (e4m3 widens to float16 in one
    instruction per pair of values, to bfloat16 in several, and widening every key and value is the kernel's ALU
    work); float32 queries keep full precision."""
    return is_fp8(k_cache) and q.dtype == torch.bfloat16


@triton.jit
def dot_operand(q, DOT_F16: tl.constexpr):
    if DOT_F16:  # float16's range is narrower than bfloat16's: saturate rather than overflow
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def load_keys_contiguous(v_base, offsets, mask_d):
    """A [D, BLOCK_N] tile of a keys-contiguous V cache (``v_base``: the head's [D, 1] row pointers; ``offsets``:
    each key's page offset plus slot, from a tile that starts page-aligned). The compiler finds the runs of a
    page's keys contiguous from the offsets' arithmetic (page * stride + pos % PAGE, the slot stride specialized to
    1; hints on a callee's argument are dropped): 16-byte loads, and an operand the P.V dot reads K-major. No key
    mask: slots past the context hold finite stale values, weighted by p = 0."""
    return tl.load(v_base + offsets[None, :], mask=mask_d[:, None], other=0.0)


@triton.jit
def decode_split(seq_lens_ptr, num_splits, BLOCK_N: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """A split decode program's (sequence, kv head, split, first key, end key); the grid is (kv heads, splits,
    batch) with ``HEADS_FIRST``, else (batch, kv heads, splits). Reads only the sequence length, a step input no
    kernel of the step writes (so it may run before the PDL wait)."""
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        split = tl.program_id(1)
        b = tl.program_id(2)
    else:
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # The split length is derived from the device-side seq_len, so the grid stays data independent.
    # Rounding to BLOCK_N keeps tiles whole except the very last one of the sequence.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    return b, kv_head, split, split_start, tl.minimum(split_start + split_len, seq_len)


@triton.jit
def decode_k_tile(
    bt_row, start_n, split_end, k_head, offs_d, mask_d, k_strides, v_strides, BLOCK_N: tl.constexpr, PAGE: tl.constexpr
):
    """A split decode tile from ``start_n``: K as [keys, D] (``k_head``: the kv head's K cache; ``bt_row``: the
    sequence's block table), each key's offset in the V cache, and the mask of keys before ``split_end``. V is
    loaded by the caller, in the orientation its dot takes (a 16-bit V loaded transposed costs ~100 registers)."""
    pos_n = start_n + tl.arange(0, BLOCK_N)
    mask_n = pos_n < split_end
    # Masked: table entries past seq_len may be garbage and must not even be read. Keys past split_end in its last
    # page get that page (read whole by V_KEYS; their p is 0).
    page = tl.load(bt_row + pos_n // PAGE, mask=pos_n // PAGE < tl.cdiv(split_end, PAGE), other=0).to(tl.int64)
    in_page = (pos_n % PAGE).to(tl.int64)
    k_off = slot_offset(k_strides, page, in_page)
    k = tl.load(k_head + offs_d[None, :] + k_off[:, None], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    return k, slot_offset(v_strides, page, in_page), mask_n  # V's slot stride is 1 when V_KEYS


@triton.jit
def exact_dot(a, b):
    """``tl.dot``, in full float32 for float32 operands: Triton's default there is TF32, whose 10-bit inputs flip
    near-tie greedy picks against HF's float32 (the EAGLE-3 draft's reference test on CUDA)."""
    if a.dtype.is_fp32():
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def softmax_tile(q, qk, v, m_i, l_i, acc, KEYS_M: tl.constexpr = False):
    """One K/V tile of the online softmax: scores ``qk`` (log2 units, masked keys at -inf) update the running max
    ``m_i`` and sum ``l_i`` and add the tile's values to ``acc``, rescaled; the dots in ``q``'s dtype. Tiles are
    [queries, keys] scores, [keys, D] values and a [queries, D] ``acc``, or with ``KEYS_M`` all transposed (the keys
    as the dots' M: [keys, queries] scores, [D, keys] values, a [D, queries] ``acc``)."""
    AXIS: tl.constexpr = 0 if KEYS_M else 1  # the keys' axis of the scores
    m_new = tl.maximum(m_i, tl.max(qk, AXIS))
    p = tl.exp2(qk - per_query(m_new, KEYS_M))
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, AXIS)
    if KEYS_M:
        acc = acc * alpha[None, :] + exact_dot(v.to(q.dtype), p.to(q.dtype))
    else:
        acc = acc * alpha[:, None] + exact_dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


@triton.jit
def per_query(x, KEYS_M: tl.constexpr):
    """A vector over the queries (heads) as a column of a [queries, *] tile, or a row of a [*, queries] one."""
    if KEYS_M:
        y = x[None, :]
    else:
        y = x[:, None]
    return y  # one return: Triton types every return of a function alike, a constexpr branch's too


@triton.jit
def per_item(x, KEYS_M: tl.constexpr):
    """A vector over the other axis (keys or head_dim) broadcast the other way: ``per_query``'s complement."""
    if KEYS_M:
        y = x[:, None]
    else:
        y = x[None, :]
    return y
