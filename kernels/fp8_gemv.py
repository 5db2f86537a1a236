"""FP8 linear layers for decode batches of a few rows: a GEMV over e4m3 weights, the activations quantized inside.

At one to four rows an FP8 linear layer is a read of its e4m3 weight, and no tensor-core tiling helps: each program
loads a 32 KB weight slice (16 KB for float32 rows; its first K step before the PDL wait), multiplies it by each
row and sums along K in float32. Each row's activation scales are computed in the program from the row itself (a
read of a few KB that every program of the row repeats from L2), so the numbers are model/fp8.py's: the row
quantized to e4m3 with its per-token (or per-group) scale, products of e4m3 values exact in float32, the scales
applied to the sums. One launch, no split-K workspace; CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_gemm import NORM_ROW_READS
from kernels.fp8_quant import FP8_MAX, MIN_AMAX
from kernels.fused import residual_added, rms_normalized
from kernels.pdl import pdl_enter, use_pdl

MAX_ROWS = 4  # rows the kernel unrolls; fp8_linear sends it fewer (kernels/fp8_gemm.py GEMV_ROWS)
_MAX_BLOCK_K = 4096


def default_tiling(x_dtype: torch.dtype) -> tuple[int, int]:
    """(slice_bytes, max_block_k): 32 KB programs, 4,096-wide steps, so each row's quantization is shared among 8
    channels (H200, W2 FP8 Qwen3-8B: 2.996 against 3.273 ms/token at 16 KB, and 3.051 with 16 KB x 1,024 for the
    products under 8,192 channels). Float32 rows take 16 KB x 1,024: with 4,096-wide steps the Triton 3.6 sm_90a
    build returned NaN at K=4352 in float32 (per-channel, and 32 KB programs over (16, 256) blocks; every 16-bit
    case was clean, the cause is not found)."""
    return (16384, 1024) if x_dtype == torch.float32 else (32768, _MAX_BLOCK_K)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    res_ptr,  # ADD_NORM: the residual stream, its sum with x (res_out_ptr) and the norm's weight; else unused
    res_out_ptr,
    norm_w_ptr,
    eps,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ws_n,
    stride_om,
    K: tl.constexpr,
    ROWS: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a power of two; K is covered in cdiv(K, BLOCK_K) steps
    GROUP_N: tl.constexpr,  # weight rows per block scale; 0: one scale per output channel and per token
    GROUP_K: tl.constexpr,  # columns per activation and weight block scale (divides BLOCK_K)
    HAS_BIAS: tl.constexpr,
    F16_SUMS: tl.constexpr,  # per-channel scales only: products and runs of 8 summed in float16 (a candidate)
    ADD_NORM: tl.constexpr,  # quantize RMSNorm(x + residual), as kernels/fused.py's rmsnorm rounds it (one step)
    USE_PDL: tl.constexpr,
):
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K if GROUP_N else 1
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # the first weight step: written by no kernel of the step, so in flight during the wait
    w_first = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
    if ADD_NORM:
        g = tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    if GROUP_N == 0:
        sw = tl.load(ws_ptr + offs_n * stride_ws_n, mask=mask_n, other=0.0)
    for r in tl.static_range(ROWS):
        # row masks as tensors: the interpreter mis-types a scalar bool broadcast into a mask
        x_row = x_ptr + r * stride_xm
        row_ok = (offs_k * 0 + r) < M
        if ADD_NORM:  # one K step (the host checks): the row normed once, in registers, for the amax and products
            in_row = row_ok & (offs_k < K)
            xs = tl.load(x_row + offs_k, mask=in_row, other=0.0)
            # the first program keeps the sum, in a buffer no program reads
            xs = residual_added(xs, res_ptr + r * K + offs_k, res_out_ptr + r * K + offs_k, in_row, pid_n == 0)
            xn = (rms_normalized(xs, K, eps) * g).to(xs.dtype).to(tl.float32)
        if GROUP_N == 0:  # one scale for the whole row: its amax first
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for s in tl.static_range(STEPS):
                ks = s * BLOCK_K + offs_k
                if ADD_NORM:
                    xa = xn
                else:
                    xa = tl.load(x_row + ks, mask=row_ok & (ks < K), other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(xa))
            sx = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
            inv = tl.math.div_rn(1.0, sx)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(STEPS):
            ks = s * BLOCK_K + offs_k
            if s == 0:
                w = w_first
            else:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & (ks < K)[None, :], other=0.0)
            if ADD_NORM:
                x = xn
            else:
                x = tl.load(x_row + ks, mask=row_ok & (ks < K), other=0.0).to(tl.float32)
            if GROUP_N == 0:
                xq = tl.clamp(x * inv, -FP8_MAX, FP8_MAX).to(w_ptr.dtype.element_ty)
                if F16_SUMS:
                    # e4m3 widens to float16 in one instruction per pair; x / 64 keeps 8 products (<= 448 * 7
                    # each) under float16's 65,504, and the products of e4m3 values are exact in float16
                    prod = w.to(tl.float16) * (xq.to(tl.float16) * 0.015625)[None, :]
                    runs = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
                    acc += tl.sum(runs.to(tl.float32), axis=1) * 64.0
                else:
                    acc += tl.sum(w.to(tl.float32) * xq.to(tl.float32)[None, :], axis=1)
            else:
                xg = tl.reshape(x, (GROUPS, GROUP_K))
                amax_g = tl.max(tl.abs(xg), axis=1)
                sxg = tl.math.div_rn(tl.maximum(amax_g, MIN_AMAX), FP8_MAX)
                # an all-zero group (past K, or zeros) quantizes to zeros either way; its 4.5e12 reciprocal made
                # the Triton 3.6 sm_90a build return NaN at K=4352 with (16, 256) blocks (an H200, deterministic)
                inv = tl.where(amax_g > 0, tl.math.div_rn(tl.full([GROUPS], 1.0, tl.float32), sxg), 0.0)
                xq = tl.clamp(xg * inv[:, None], -FP8_MAX, FP8_MAX).to(w_ptr.dtype.element_ty)
                prod = w.to(tl.float32) * tl.reshape(xq.to(tl.float32), (BLOCK_K,))[None, :]
                part = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, GROUP_K)), axis=2)  # [BLOCK_N, GROUPS]
                g = s * GROUPS + tl.arange(0, GROUPS)
                g_ok = (g * GROUP_K < K)[None, :] & mask_n[:, None]
                swg = tl.load(ws_ptr + (offs_n // GROUP_N)[:, None] * stride_ws_n + g[None, :], mask=g_ok, other=0.0)
                acc += tl.sum(part * sxg[None, :] * swg, axis=1)
        if GROUP_N == 0:
            acc = acc * sx * sw
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + r * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n & ((offs_n * 0 + r) < M)
        )


def gemv_tiles(k: int, block: tuple[int, int] | None, slice_bytes: int, max_block_k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): K steps of at most ``max_block_k`` columns (whole block-scale groups), ``slice_bytes`` of
    weight a step (a program shares its rows' quantization among BLOCK_N channels)."""
    block_k = min(max_block_k, triton.next_power_of_2(k))
    if block is not None:
        block_k = max(block_k, block[1])
    return max(1, slice_bytes // block_k), block_k


def supports(m: int, k: int, block: tuple[int, int] | None) -> bool:
    """Whether ``fp8_gemv`` takes a product: a few rows; block scales in power-of-two groups of K within a step."""
    if not 0 < m <= MAX_ROWS:
        return False
    return block is None or (block[1] & (block[1] - 1) == 0 and block[1] <= _MAX_BLOCK_K)


def fp8_gemv(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    slice_bytes: int | None = None,
    f16_sums: bool = False,
    max_block_k: int | None = None,
    norm: tuple | None = None,
) -> torch.Tensor:
    """``out = quant(x) @ (w_q * w_s).T (+ bias)`` for ``x`` [M <= MAX_ROWS, K] in 16 bits (or float32): scales
    per token and output channel [N] (``block`` None), or per token and ``block[1]`` columns against per-block
    weight scales [N / block[0], K / block[1]]. ``slice_bytes``, ``max_block_k``: weight per program and step and
    its width (gemv_tiles; None: ``default_tiling``).
    ``f16_sums`` (per-channel scales): the candidate that multiplies and sums runs of 8 in float16, fewer
    conversions per weight byte; its rounding is float16's, not the emulation's (benchmarks/fp8_gemm.py times it).
    ``norm``: ``fp8_gemv_add_norm``'s operands (residual, sum, norm weight, eps); ``x`` is then added to them."""
    m, k = x.shape
    n = w_q.shape[0]
    assert supports(m, k, block) and x.stride(1) == 1 and w_q.stride(1) == 1, (x.shape, block)
    default_slice, default_width = default_tiling(x.dtype)
    block_n, block_k = gemv_tiles(k, block, slice_bytes or default_slice, max_block_k or default_width)
    pdl = use_pdl(x)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w_q,
        w_s,
        bias if bias is not None else out,
        out,
        *(norm or (x, x, w_s, 0.0)),
        m,
        n,
        x.stride(0),
        w_q.stride(0),
        w_s.stride(0),
        out.stride(0),
        K=k,
        ROWS=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_N=0 if block is None else block[0],
        GROUP_K=1 if block is None else block[1],
        HAS_BIAS=bias is not None,
        F16_SUMS=f16_sums and block is None,
        ADD_NORM=norm is not None,
        USE_PDL=pdl,
        num_warps=8 if x.is_cuda else 1,
        launch_pdl=pdl,
    )
    return out


def norm_fits(x: torch.Tensor, w_q: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether ``fp8_gemv_add_norm`` takes ``x``: one 16-bit contiguous row whose K one step covers, and programs x K
    within kernels/decode_gemm.py's NORM_ROW_READS (each program norms the row again)."""
    m, k = x.shape
    if not (m == 1 and x.dtype != torch.float32 and x.is_contiguous() and supports(m, k, block)):
        return False
    block_n, block_k = gemv_tiles(k, block, *default_tiling(x.dtype))
    return k <= block_k and triton.cdiv(w_q.shape[0], block_n) * k <= NORM_ROW_READS


def fp8_gemv_add_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    block: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(``fp8_gemv`` of RMSNorm(x + residual), x + residual) in one launch, rounded as kernels/fused.py's rmsnorm
    followed by ``fp8_gemv``, for the rows ``norm_fits`` takes (the norm's own launch saved); None for others."""
    if not norm_fits(x, w_q, block):
        return None
    assert residual.shape == x.shape and residual.is_contiguous(), (x.shape, residual.shape)
    out = torch.empty((x.shape[0], w_q.shape[0]), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x)
    fp8_gemv(x, w_q, w_s, block, None, out, norm=(residual, res_out, norm_weight, eps))
    return out, res_out
