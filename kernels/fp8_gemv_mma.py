"""FP8 linear layers for small decode batches on tensor cores: the product computed transposed ("swap AB"),
``out.T = w @ quant(x).T``, so the weight's output channels fill the MMA's M side (64 or more) and the few rows of
``x``, padded with zeros to 16, its N side.

The CUDA-core GEMV (kernels/fp8_gemv.py) widens every e4m3 weight byte to float32 before its multiply-add, and
those conversions run on a narrow pipe: at one row it streams the weight at ~2.2 TB/s. Tensor cores take e4m3
operands as they are, so here a weight byte costs no instruction of its own; the only conversions left are the
activation tile's, shared by BLOCK_N weight rows. Each program quantizes the rows itself (model/fp8.py's
arithmetic: per-token scale amax / 448, or per token and GROUP_K columns), loads its weight slice through a
pipelined K loop, and applies the scales to the float32 accumulator. One launch, CUDA-graph safe; also runs under
``TRITON_INTERPRET=1`` on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8_MAX, MIN_AMAX
from kernels.pdl import pdl_enter, use_pdl

MAX_ROWS = 16  # the MMA's N side: the rows of x, zero-padded


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_mma_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ws_n,
    stride_om,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # with block scales, GROUP_K (one scale group per step)
    GROUP_N: tl.constexpr,  # weight rows per block scale; 0: one scale per output channel and per token
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    ROWS: tl.constexpr = 16
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_m = offs_n < N, offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    pdl_enter(USE_PDL)
    if GROUP_N == 0:  # one scale per row: the row's amax first (a read of a few KB, from L2 after the first program)
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = (offs_k < BLOCK_K) if EVEN_K else (k + offs_k < K)
            xa = tl.load(x_ptrs + k, mask=mask_m[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xa), axis=1))
        sx = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = (offs_k < BLOCK_K) if EVEN_K else (k + offs_k < K)
        w = tl.load(w_ptrs + k, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + k, mask=mask_m[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if GROUP_N == 0:
            xq = tl.clamp(tl.math.div_rn(x, sx[:, None]), -FP8_MAX, FP8_MAX).to(w_ptr.dtype.element_ty)
            acc = tl.dot(w, tl.trans(xq), acc)
        else:
            sxg = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), FP8_MAX)
            xq = tl.clamp(tl.math.div_rn(x, sxg[:, None]), -FP8_MAX, FP8_MAX).to(w_ptr.dtype.element_ty)
            swg = tl.load(ws_ptr + (offs_n // GROUP_N) * stride_ws_n + k // GROUP_K, mask=mask_n, other=0.0)
            acc += tl.dot(w, tl.trans(xq)) * swg[:, None] * sxg[None, :]
    if GROUP_N == 0:
        sw = tl.load(ws_ptr + offs_n * stride_ws_n, mask=mask_n, other=0.0)
        acc = acc * sw[:, None] * sx[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def supports(m: int, k: int, block: tuple[int, int] | None) -> bool:
    """Whether ``fp8_gemv_mma`` takes a product: up to 16 rows; block scales in power-of-two groups of >= 32 columns."""
    if not 0 < m <= MAX_ROWS or k < 32:
        return False
    return block is None or (block[1] & (block[1] - 1) == 0 and block[1] >= 32)


def fp8_gemv_mma(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tiles: tuple[int, int, int, int] = (64, 128, 4, 4),
) -> torch.Tensor:
    """``out = quant(x) @ (w_q * w_s).T (+ bias)`` for ``x`` [M <= 16, K] in 16 bits (or float32), the scales as in
    kernels/fp8_gemv.py. ``tiles``: (BLOCK_N, BLOCK_K, warps, pipeline stages); with block scales BLOCK_K is the
    scale group's width."""
    m, k = x.shape
    n = w_q.shape[0]
    assert supports(m, k, block) and x.stride(1) == 1 and w_q.stride(1) == 1, (x.shape, block)
    block_n, block_k, warps, stages = tiles
    if block is not None:
        block_k = block[1]
    pdl = use_pdl(x)
    _fp8_gemv_mma_kernel[(triton.cdiv(n, block_n),)](
        x,
        w_q,
        w_s,
        bias if bias is not None else out,
        out,
        m,
        n,
        x.stride(0),
        w_q.stride(0),
        w_s.stride(0),
        out.stride(0),
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_N=0 if block is None else block[0],
        GROUP_K=1 if block is None else block[1],
        HAS_BIAS=bias is not None,
        STAGES=stages if x.is_cuda else 1,
        USE_PDL=pdl,
        num_warps=warps if x.is_cuda else 1,
        launch_pdl=pdl,
    )
    return out
