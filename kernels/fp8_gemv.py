"""FP8 linear layers for decode batches of a few rows: a GEMV over e4m3 weights, the activations quantized inside.

At one to four rows an FP8 linear layer is a read of its e4m3 weight, and no tensor-core tiling helps. Each program
owns a few output channels and walks K in 16 KB weight steps (the first loaded before the PDL wait): it converts a
step's weights to float32 once and multiplies them by every row. The rows are quantized in the program (a read of a
few KB that every program repeats from L2) with model/fp8.py's numbers: per-token (or per-group) scales, each value
times the scale's reciprocal rounded to e4m3; products of e4m3 values are exact in float32 and the scales apply to
the sums. One launch, no workspace; CUDA-graph safe. The x work is shared by the program's channels, so a program
holds 8 or more of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8_MAX, MIN_AMAX
from kernels.pdl import pdl_enter, use_pdl

MAX_ROWS = 4  # more rows go to the tensor-core paths: the GEMV's multiply-adds grow with each row
_STEP = 16384  # weight elements (bytes) per program and K step
_MAX_BLOCK_K = 2048  # so a program holds >= 8 channels to share each row's quantization


@triton.jit
def _quantized_row(x_row, ks, ok, inv):
    """One row's K step quantized with one scale (its reciprocal ``inv``), as float32 e4m3 values."""
    x = tl.load(x_row + ks, mask=ok, other=0.0).to(tl.float32)
    return tl.clamp(x * inv, -FP8_MAX, FP8_MAX).to(tl.float8e4nv).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ws_n,
    stride_om,
    ROWS: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a power of two
    GROUP_N: tl.constexpr,  # weight rows per block scale; 0: one scale per output channel and per token
    GROUP_K: tl.constexpr,  # columns per activation and weight block scale (divides BLOCK_K)
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K if GROUP_N else 1
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # the first weight step: written by no kernel of the step, so in flight during the wait
    w_next = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_enter(USE_PDL)
    if GROUP_N == 0:  # one scale per row: every row's amax first
        amax = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            ok = (rows[:, None] < M) & (ks < K)[None, :]
            xa = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=ok, other=0.0)
            amax = tl.maximum(amax, tl.abs(xa.to(tl.float32)))
        sx = tl.math.div_rn(tl.maximum(tl.max(amax, axis=1), MIN_AMAX), FP8_MAX)  # [ROWS]
        inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), sx)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        w = w_next.to(tl.float32)
        nks = ks + BLOCK_K
        w_next = tl.load(w_rows + nks[None, :], mask=mask_n[:, None] & (nks < K)[None, :], other=0.0)
        for r in tl.static_range(ROWS):
            # row masks as tensors: the interpreter mis-types a scalar bool broadcast into a mask
            ok = ((offs_k * 0 + r) < M) & (ks < K)
            if GROUP_N == 0:
                inv_r = tl.sum(tl.where(rows == r, inv, 0.0), axis=0)
                part = tl.sum(w * _quantized_row(x_ptr + r * stride_xm, ks, ok, inv_r)[None, :], axis=1)
            else:
                x = tl.load(x_ptr + r * stride_xm + ks, mask=ok, other=0.0).to(tl.float32)
                xg = tl.reshape(x, (GROUPS, GROUP_K))
                sxg = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xg), axis=1), MIN_AMAX), FP8_MAX)
                invg = tl.math.div_rn(tl.full([GROUPS], 1.0, tl.float32), sxg)
                xq = tl.clamp(xg * invg[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv).to(tl.float32)
                prod = w * tl.reshape(xq, (BLOCK_K,))[None, :]
                sums = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, GROUP_K)), axis=2)  # [BLOCK_N, GROUPS]
                g = k0 // GROUP_K + tl.arange(0, GROUPS)
                g_ok = (g * GROUP_K < K)[None, :] & mask_n[:, None]
                swg = tl.load(ws_ptr + (offs_n // GROUP_N)[:, None] * stride_ws_n + g[None, :], mask=g_ok, other=0.0)
                part = tl.sum(sums * sxg[None, :] * swg, axis=1)
            acc += tl.where(rows[:, None] == r, part[None, :], 0.0)
    if GROUP_N == 0:
        acc = acc * sx[:, None] * tl.load(ws_ptr + offs_n * stride_ws_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & mask_n[None, :])


def gemv_tiles(k: int, block: tuple[int, int] | None) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): K steps of at most 2,048 columns (whole block-scale groups), 16 KB of weight a step."""
    block_k = min(_MAX_BLOCK_K, triton.next_power_of_2(k))
    if block is not None:
        block_k = max(block_k, block[1])
    return max(1, _STEP // block_k), block_k


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
) -> torch.Tensor:
    """``out = quant(x) @ (w_q * w_s).T (+ bias)`` for ``x`` [M <= MAX_ROWS, K] in 16 bits (or float32): scales
    per token and output channel [N] (``block`` None), or per token and ``block[1]`` columns against per-block
    weight scales [N / block[0], K / block[1]]."""
    m, k = x.shape
    n = w_q.shape[0]
    assert supports(m, k, block) and x.stride(1) == 1 and w_q.stride(1) == 1, (x.shape, block)
    block_n, block_k = gemv_tiles(k, block)
    pdl = use_pdl(x)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w_q,
        w_s,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x.stride(0),
        w_q.stride(0),
        w_s.stride(0),
        out.stride(0),
        ROWS=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_N=0 if block is None else block[0],
        GROUP_K=1 if block is None else block[1],
        HAS_BIAS=bias is not None,
        USE_PDL=pdl,
        num_warps=8 if x.is_cuda else 1,
        launch_pdl=pdl,
    )
    return out
