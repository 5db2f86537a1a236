"""Triton kernels for paged attention: KV store, variable-length prefill ("extend") and split-K decode.

Layout and metadata are those of :mod:`kernels.attention`; ``TorchAttentionBackend`` is the oracle.
The kernels run on CUDA and, for tests, on CPU tensors under ``TRITON_INTERPRET=1``.
They need Triton 3.4 or newer (programmatic dependent launch, kernels/pdl.py) and nothing newer than 3.6.

Launches never read device values on the host (no ``.item()`` / ``.tolist()``): grids come from tensor
shapes and host ints in the metadata, so decode can be captured in a CUDA graph.

An e4m3 (FP8) cache holds ``value / scale`` with one float scale for K and one for V (``k_scale``, ``v_scale``;
the model uses 1.0, as vLLM does without calibrated scales): the store kernel divides and saturates at 448, the
attention kernels read e4m3 tiles, widen them (and a bf16 query) to float16 for the dots, fold ``k_scale`` into the
softmax scale and apply ``v_scale`` to the output. A 16-bit cache ignores the scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import AttentionBackend, AttentionMetadata, cache_scales, is_fp8
from kernels.device import num_sms
from kernels.pdl import pdl_enter, use_pdl

_LOG2E = 1.4426950408889634


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
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    inv_k_scale,
    inv_v_scale,
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
    kc = k_cache_ptr + slot * stride_kc_slot + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    vc = v_cache_ptr + slot * stride_vc_slot + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------------
# prefill / extend
# ----------------------------------------------------------------------------------------------------------------------


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
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt,
    GROUP: tl.constexpr,  # q heads per kv head
    PAGE: tl.constexpr,  # cache block size
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F16: tl.constexpr,  # dot_dtype_f16
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
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        q_pos = prefix + offs_m

        q_rows = (q_start + offs_m).to(tl.int64)
        q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = dot_operand(tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0), DOT_F16)

        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_cache_ptr + kv_head * stride_kc_h + offs_d[None, :]
        v_base = v_cache_ptr + kv_head * stride_vc_h + offs_d[None, :]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # Keys below `full_end` are visible to every query of this block (no mask needed); keys in
        # [full_end, kv_end) straddle the causal diagonal. Key 0 is in the first tile either way, so every
        # row has a finite running max after one iteration and fully-masked tiles never yield NaN.
        first_pos = prefix + pid_m * BLOCK_M
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        kv_end = tl.minimum(kv_len, first_pos + BLOCK_M)

        for start_n in range(0, full_end, BLOCK_N):
            pos_n = start_n + offs_n
            page = tl.load(bt_row + pos_n // PAGE).to(tl.int64)
            in_page = (pos_n % PAGE).to(tl.int64)
            k = tl.load(k_base + (page * stride_kc_b + in_page * stride_kc_s)[:, None], mask=mask_d[None, :], other=0.0)
            v = tl.load(v_base + (page * stride_vc_b + in_page * stride_vc_s)[:, None], mask=mask_d[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_i = m_new

        for start_n in range(full_end, kv_end, BLOCK_N):
            pos_n = start_n + offs_n
            # Never touch block-table entries or cache slots at or past kv_len: they may be garbage.
            mask_n = pos_n < kv_len
            page = tl.load(bt_row + pos_n // PAGE, mask=mask_n, other=0).to(tl.int64)
            in_page = (pos_n % PAGE).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + (page * stride_kc_b + in_page * stride_kc_s)[:, None], mask=kv_mask, other=0.0)
            v = tl.load(v_base + (page * stride_vc_b + in_page * stride_vc_s)[:, None], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
            causal = (pos_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
            qk = tl.where(causal, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_i = m_new

        acc = acc / l_i[:, None] * v_scale
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# ----------------------------------------------------------------------------------------------------------------------
# decode: split-K stage 1 (partial attention per context split) + stage 2 (merge)
# ----------------------------------------------------------------------------------------------------------------------


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
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt,
    num_splits,  # runtime int: a new split count does not recompile
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to >= 16 so the group's scores are one tl.dot
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # single split: normalise and write the final output, no merge pass
    HEADS_FIRST: tl.constexpr,  # grid (kv heads, splits, batch): a sequence's heads run side by side
    DOT_F16: tl.constexpr,  # dot_dtype_f16
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
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
    split_end = tl.minimum(split_start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    b64 = b.to(tl.int64)
    q_ptrs = q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = dot_operand(tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0), DOT_F16)

    bt_row = block_tables_ptr + b64 * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kc_h + offs_d[None, :]
    v_base = v_cache_ptr + kv_head * stride_vc_h + offs_d[None, :]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    # Every tile starts below split_end, so it holds at least one valid key: the running max is finite
    # from the first iteration on (padded head rows have q = 0, hence finite scores too).
    for start_n in range(split_start, split_end, BLOCK_N):
        pos_n = start_n + offs_n
        mask_n = pos_n < split_end
        # Masked: table entries past seq_len may be garbage and must not even be read.
        page = tl.load(bt_row + pos_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        in_page = (pos_n % PAGE).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + (page * stride_kc_b + in_page * stride_kc_s)[:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_base + (page * stride_vc_b + in_page * stride_vc_s)[:, None], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    # Empty split (or seq_len == 0): l_i = 0, acc = 0 -> writes zeros and lse = -inf, which the merge ignores.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None] * v_scale
    o_mask = mask_h[:, None] & mask_d[None, :]
    if DIRECT_OUT:
        o_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        o_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        tl.store(o_ptrs, acc, mask=o_mask)
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
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(lse_ptr + b * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    # All splits empty (seq_len == 0 padding row): shift by 0 so the weights are exp2(-inf) = 0, output 0.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    parts = tl.load(
        part_ptr + b * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    o = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)


# ----------------------------------------------------------------------------------------------------------------------
# backend
# ----------------------------------------------------------------------------------------------------------------------


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # Kernels index the last dim with unit stride; the other strides are passed through.
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV cache must have a contiguous head_dim")


def _kernel_scales(k_cache: torch.Tensor, scale: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The prefill and decode kernels' two scale arguments: q.k's (base-2 exponent, K's cache scale folded in), V's."""
    k_mult, v_mult = cache_scales(k_cache, k_scale, v_scale)
    return scale * _LOG2E * k_mult, v_mult


def _page_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """Block, slot and head strides of the paged K then V cache, as the prefill and decode kernels take them."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention.

    Metadata dtypes: ``slot_mapping`` int32 or int64; ``cu_seqlens_q``, ``prefill_seq_lens``,
    ``decode_seq_lens`` and both block tables int32 (int64 also works); block tables need a unit
    stride along the blocks dim. ``q``/``k``/``v`` may be strided views (e.g. slices of a fused qkv),
    but their head_dim must be contiguous.

    Decode splits the context over ``num_splits`` programs per (sequence, kv head), picked on the host
    from the batch size, the SM count and ``meta.max_decode_seq_len`` (capped by ``max_splits``). The
    kernel derives each split's range from the device-side seq_len, so any ``num_splits`` is correct
    for any lengths: a CUDA graph captured with one value replays correctly for all lengths.
    """

    # Decode regimes by programs per split (batch x kv heads), measured on an H200:
    # from DIRECT_PROGRAMS_PER_SM x SMs up, one 128-key program per (sequence, kv head) streams at the copy
    # ceiling; from MID_MIN_PROGRAMS up, 64-key programs split so that ~MID_PROGRAMS_PER_SM x SMs programs run
    # beat it by 3-8%; below that, the long-context few-sequence case, splits fill the GPU as before.
    DIRECT_PROGRAMS_PER_SM = 12
    MID_PROGRAMS_PER_SM = 32
    MID_MIN_PROGRAMS = 128

    name = "triton"

    def __init__(
        self,
        max_splits: int = 32,
        min_split_tokens: int = 256,
        programs_per_sm: int = 4,
        decode_tiles: tuple[int, int, int] | None = None,
        decode_heads_first: bool = True,
        prefill_tiles: tuple[int, int, int, int] | None = None,
    ) -> None:
        self.max_splits = max_splits  # bounds the grid and the partial-result buffers
        self.min_split_tokens = min_split_tokens  # shorter splits cost more in merging than they win
        self.programs_per_sm = programs_per_sm
        # CUDA decode tiling (keys per tile, warps, pipeline stages); None = the default below.
        # benchmarks/attention_kernels.py --sweep-decode measures the alternatives.
        self.decode_tiles = decode_tiles
        # Grid order (kv heads, splits, batch): the programs of one sequence's kv heads run side by side and
        # read the interleaved head slices of the same cache pages together (W1 0.6B +2-4% on an H200).
        self.decode_heads_first = decode_heads_first
        # CUDA prefill tiling (queries per tile, keys per tile, warps, stages); None = the default below
        # (benchmarks/attention_kernels.py --sweep-prefill measures the alternatives).
        self.prefill_tiles = prefill_tiles

    # -- store ---------------------------------------------------------------------------------------------------------

    def store_kvcache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        _check_cache(k_cache, v_cache)
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("k and v must have a contiguous head_dim")
        # Slots address [num_blocks * block_size] rows; viewing keeps that valid for padded strides too.
        kc = k_cache.view(-1, num_kv_heads, head_dim)
        vc = v_cache.view(-1, num_kv_heads, head_dim)
        pdl = use_pdl(k)
        _store_kvcache_kernel[(num_tokens,)](
            k,
            v,
            kc,
            vc,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            kc.stride(0),
            kc.stride(1),
            vc.stride(0),
            vc.stride(1),
            1.0 / k_scale,
            1.0 / v_scale,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            KV_FP8=is_fp8(k_cache),
            USE_PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )

    # -- prefill -------------------------------------------------------------------------------------------------------

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal attention of each prefill chunk over its cached prefix and itself; ``out`` may be preallocated."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        if out is None:
            out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if num_tokens == 0 or meta.num_prefills == 0:
            return out
        if meta.max_seqlen_q <= 0:
            raise ValueError("meta.max_seqlen_q must be set (host int) for the Triton prefill grid")
        _check_cache(k_cache, v_cache)
        assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and out.stride(-1) == 1
        bt = meta.prefill_block_tables
        assert bt.stride(-1) == 1

        block_d = max(16, triton.next_power_of_2(head_dim))
        pdl = use_pdl(q)
        if q.is_cuda:
            # head_dim <= 128: 64 x 64 tiles, 4 warps, 1.24-1.27x faster than 128 x 64 with 8 warps on W1-like
            # prompts of 100-1,024 tokens (H200); smaller tiles for wide heads (registers).
            default = (64, 64, 4, 2) if block_d <= 128 else (64, 32, 4, 2)
            block_m, block_n, num_warps, num_stages = self.prefill_tiles or default
        else:
            block_m, block_n, num_warps, num_stages = 16, 16, 1, 1
        # max_seqlen_q is a host int: no device sync; programs past a sequence's length exit at once.
        grid = (triton.cdiv(meta.max_seqlen_q, block_m), num_heads, meta.num_prefills)
        _prefill_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            meta.cu_seqlens_q,
            meta.prefill_seq_lens,
            bt,
            *_kernel_scales(k_cache, scale, k_scale, v_scale),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *_page_strides(k_cache, v_cache),
            bt.stride(0),
            GROUP=num_heads // num_kv_heads,
            PAGE=page,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            DOT_F16=dot_dtype_f16(q, k_cache),
            USE_PDL=pdl,
            num_warps=num_warps,
            num_stages=num_stages,
            launch_pdl=pdl,
        )
        return out

    # -- decode --------------------------------------------------------------------------------------------------------

    def num_decode_splits(self, batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        """Host-only split policy: enough programs to fill the GPU, but splits of >= min_split_tokens."""
        programs, sms = max(1, batch * num_kv_heads), num_sms(device, cpu=4)
        if programs >= self.DIRECT_PROGRAMS_PER_SM * sms:
            return 1
        if programs >= self.MID_MIN_PROGRAMS:  # the largest power of two within the mid regime's target
            want = 1 << max(1, (self.MID_PROGRAMS_PER_SM * sms // programs).bit_length() - 1)
        else:
            want = triton.cdiv(sms * self.programs_per_sm, programs)
        if max_seq_len > 0:  # 0 = unknown: do not cap by length
            want = min(want, triton.cdiv(max_seq_len, self.min_split_tokens))
        return max(1, min(want, self.max_splits))

    def warmup(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """Compile every decode variant a run can meet (single split, each merge width up to max_splits, the
        tiles of both the few-sequence and the mid regime) at start-up, so no timed step stalls on the compiler."""
        head_dim, device, num_kv_heads = k_cache.shape[3], k_cache.device, k_cache.shape[2]
        for batch in sorted({2, triton.cdiv(self.MID_MIN_PROGRAMS, num_kv_heads)}):
            q = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=device)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
                num_prefill_tokens=0,
                num_prefills=0,
                num_decodes=batch,
                decode_seq_lens=torch.ones(batch, dtype=torch.int32, device=device),
                decode_block_tables=torch.zeros(batch, 3, dtype=torch.int32, device=device),
            )
            splits = 1
            while True:
                self.decode(q, k_cache, v_cache, meta, 1.0, num_splits=splits)
                if splits >= self.max_splits:
                    break
                splits = min(2 * splits, self.max_splits)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        num_splits: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """One query per row of ``q``; rows with seq_len 0 (batch padding) get zeros.

        ``num_splits`` overrides the split policy (e.g. to pin it while capturing CUDA graphs).
        """
        batch, num_heads, head_dim = q.shape
        num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        if out is None:
            out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if batch == 0:
            return out
        _check_cache(k_cache, v_cache)
        assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and out.stride(-1) == 1
        bt = meta.decode_block_tables
        assert bt.stride(-1) == 1
        group = num_heads // num_kv_heads
        if num_splits is None:
            num_splits = self.num_decode_splits(batch, num_kv_heads, meta.max_decode_seq_len, q.device)

        block_d = max(16, triton.next_power_of_2(head_dim))
        pdl = use_pdl(q)
        block_h = max(16, triton.next_power_of_2(group))
        if q.is_cuda:
            # 128-key tiles: 3-4% faster than 64 at batch 256 on an H200; two stages of K and V tiles then take
            # 128 KB of shared memory at head_dim 128 in 16-bit types (64 keys in fp32). The split programs of the
            # mid regime take 64 keys, the best tiling there in the H200 sweeps (see num_decode_splits).
            mid = num_splits > 1 and batch * num_kv_heads >= self.MID_MIN_PROGRAMS
            wide = block_d <= 128 and k_cache.element_size() <= 2 and not mid
            block_n = 128 if wide else (64 if block_d <= 128 else 32)
            block_n, num_warps, num_stages = self.decode_tiles or (block_n, 4, 2)
        else:
            block_n, num_warps, num_stages = 16, 1, 1

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

        heads_first = self.decode_heads_first
        grid = (num_kv_heads, num_splits, batch) if heads_first else (batch, num_kv_heads, num_splits)
        _decode_split_kernel[grid](
            q,
            k_cache,
            v_cache,
            meta.decode_seq_lens,
            bt,
            part,
            lse,
            *_kernel_scales(k_cache, scale, k_scale, v_scale),
            q.stride(0),
            q.stride(1),
            *part_strides,
            *lse_strides,
            *_page_strides(k_cache, v_cache),
            bt.stride(0),
            num_splits,
            GROUP=group,
            PAGE=page,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            DIRECT_OUT=direct,
            HEADS_FIRST=heads_first,
            DOT_F16=dot_dtype_f16(q, k_cache),
            USE_PDL=pdl,
            num_warps=num_warps,
            num_stages=num_stages,
            launch_pdl=pdl,
        )
        if not direct:
            _decode_merge_kernel[(batch, num_heads)](
                part,
                lse,
                out,
                *part_strides,
                *lse_strides,
                out.stride(0),
                out.stride(1),
                num_splits,
                HEAD_DIM=head_dim,
                BLOCK_S=triton.next_power_of_2(num_splits),
                BLOCK_D=block_d,
                USE_PDL=pdl,
                num_warps=4 if q.is_cuda else 1,
                launch_pdl=pdl,
            )
        return out
