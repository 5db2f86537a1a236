"""FP8 linear layers for decode batches of a few rows: a GEMV over e4m3 weights, the activations quantized inside.

At one to four rows an FP8 linear layer is a read of its e4m3 weight, and no tensor-core tiling helps: each program
loads a weight slice of 16-32 KB in one to four K steps (``default_tiling``; its first step and its channel scales
before the PDL wait), multiplies it by each row and sums along K. Each row's activation scales are computed in
the program from the row itself (a read of a few KB that every program of the row repeats from L2), so the numbers
are model/fp8.py's: the row quantized to e4m3 with its per-token (or per-group) scale, products of e4m3 values exact,
the scales applied to the sums. Where the kernel in front (an RMSNorm, a SiLU-and-mul) has quantized the row
already, with the same arithmetic, the programs read its e4m3 values and scale instead. Sums are float32; a 16-bit
row under per-channel scales first sums runs of 8 products in float16 (fewer conversions per weight byte), a GEMM
rounding under bf16's output rounding; each thread keeps its runs' sums over the K steps, summed across threads once.
One launch, no split-K workspace; CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8_MAX, MIN_AMAX
from kernels.pdl import pdl_enter, use_pdl

MAX_ROWS = 4  # rows the kernel unrolls; fp8_linear sends it fewer (kernels/fp8_gemm.py GEMV_ROWS)
_MAX_BLOCK_K = 4096


def default_tiling(x_dtype: torch.dtype, k: int, block: tuple[int, int] | None) -> tuple[int, int]:
    """(slice_bytes, max_block_k) for ``gemv_tiles``, from `python -m benchmarks.fp8_gemm --rows 1` on an H200 (us a
    Qwen3-8B product, each behind its norm; log 43):
    - e4m3 rows (quantized by the kernel in front: nothing to share): 16 KB steps 2,048 wide where K <= 4,096, so a
      program streams 2 steps of 8 channels and sums across its threads once (qkv 9.61 -> 8.56, gate/up 26.51 ->
      25.82); at K = 12,288 (down) 4,096-wide steps of 4 channels (14.79; 2,048-wide: 17.25);
    - 16-bit rows under per-channel scales (o_proj, behind the attention): 16 KB steps 1,024 wide where K <= 4,096,
      16 channels sharing the row's amax pass and quantization over 4 steps (8.22 -> 6.88); else 32 KB programs,
      4,096-wide steps, 8 channels sharing it (log 21b);
    - float32 rows: 16 KB x 1,024, because with 4,096-wide steps the Triton 3.6 sm_90a build returned NaN at
      K=4352 in float32 (per-channel, and 32 KB programs over (16, 256) blocks; every 16-bit case was clean, the
      cause is not found)."""
    if x_dtype == torch.float8_e4m3fn:
        return (16384, 2048 if k <= 4096 else _MAX_BLOCK_K)
    if x_dtype == torch.float32:
        return (16384, 1024)
    return (16384, 1024) if block is None and k <= 4096 else (32768, _MAX_BLOCK_K)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    xs_ptr,  # X_QUANTIZED: the rows' per-token scales [M]; else unused
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
    F16_SUMS: tl.constexpr,  # per-channel scales only: products and runs of 8 summed in float16
    X_QUANTIZED: tl.constexpr,  # per-channel scales only: x is e4m3 already, quantized per token (no amax pass)
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
    # the channel scales and bias too: loaded after the wait, they came from the HBM behind the weight streams and
    # their latency showed after the sums (with the one-pass sum below, W2 FP8 2.690 -> 2.659 ms/token)
    if GROUP_N == 0:
        sw = tl.load(ws_ptr + offs_n * stride_ws_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    for r in tl.static_range(ROWS):
        # row masks as tensors: the interpreter mis-types a scalar bool broadcast into a mask
        x_row = x_ptr + r * stride_xm
        row_ok = (offs_k * 0 + r) < M
        if X_QUANTIZED:  # a padding row (r >= M) reads the last row's scale and stores nothing
            sx = tl.load(xs_ptr + tl.minimum(r, M - 1))
        elif GROUP_N == 0:  # one scale for the whole row: its amax first
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for s in tl.static_range(STEPS):
                ks = s * BLOCK_K + offs_k
                xa = tl.load(x_row + ks, mask=row_ok & (ks < K), other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(xa))
            sx = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
            inv = tl.math.div_rn(1.0, sx)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if F16_SUMS:
            runs_acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)  # each thread's runs, over all K steps
        for s in tl.static_range(STEPS):
            ks = s * BLOCK_K + offs_k
            if s == 0:
                w = w_first
            else:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & (ks < K)[None, :], other=0.0)
            if X_QUANTIZED:
                xq = tl.load(x_row + ks, mask=row_ok & (ks < K), other=0.0)
            else:
                x = tl.load(x_row + ks, mask=row_ok & (ks < K), other=0.0).to(tl.float32)
            if GROUP_N == 0:
                if not X_QUANTIZED:
                    xq = tl.clamp(x * inv, -FP8_MAX, FP8_MAX).to(w_ptr.dtype.element_ty)
                if F16_SUMS:
                    # e4m3 widens to float16 in one instruction per pair; x / 64 keeps 8 products (<= 448 * 7
                    # each) under float16's 65,504, and the products of e4m3 values are exact in float16
                    prod = w.to(tl.float16) * (xq.to(tl.float16) * 0.015625)[None, :]
                    runs_acc += tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 8, 8)), axis=2).to(tl.float32)
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
        if F16_SUMS:  # summed across threads once, not once a K step (down_proj: -1 us)
            acc = tl.sum(runs_acc, axis=1) * 64.0
        if GROUP_N == 0:
            acc = acc * sx * sw
        if HAS_BIAS:
            acc += bias
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
    f16_sums: bool | None = None,
    max_block_k: int | None = None,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = quant(x) @ (w_q * w_s).T (+ bias)`` for ``x`` [M <= MAX_ROWS, K] in 16 bits (or float32): scales
    per token and output channel [N] (``block`` None), or per token and ``block[1]`` columns against per-block
    weight scales [N / block[0], K / block[1]]. ``slice_bytes``, ``max_block_k``: weight per program and step and
    its width (gemv_tiles; None: ``default_tiling``).
    ``f16_sums`` (per-channel scales): multiply and sum runs of 8 in float16, fewer conversions per weight byte; a
    GEMM rounding of its own, under bf16's output rounding (None: for 16-bit or e4m3 rows; float32 rows sum in float32).
    ``x_scales`` [M] (per-channel scales): ``x`` is e4m3, already quantized by these per-token scales."""
    m, k = x.shape
    n = w_q.shape[0]
    assert supports(m, k, block) and x.stride(1) == 1 and w_q.stride(1) == 1, (x.shape, block)
    assert x_scales is None or (block is None and x.dtype == w_q.dtype and x_scales.numel() == m), x_scales
    default_slice, default_width = default_tiling(x.dtype, k, block)
    block_n, block_k = gemv_tiles(k, block, slice_bytes or default_slice, max_block_k or default_width)
    if f16_sums is None:
        f16_sums = x_scales is not None or x.dtype != torch.float32
    pdl = use_pdl(x)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w_q,
        w_s,
        bias if bias is not None else out,
        out,
        x_scales if x_scales is not None else w_s,
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
        X_QUANTIZED=x_scales is not None,
        USE_PDL=pdl,
        num_warps=8 if x.is_cuda else 1,
        launch_pdl=pdl,
    )
    return out
