"""FP8 linear layers on CUDA: ``x @ w.T`` on e4m3 operands with float32 scales, the activations quantized
dynamically per token (or per token and 128 columns).

Which kernel: one row, kernels/fp8_gemv.py (a read of the weight; it quantizes the row itself). More rows:
``torch._scaled_mm`` (cuBLASLt FP8, kernels/scaled_mm.py) after kernels/fp8_quant.py, where this build and device
run the scaling (rowwise scales for per-channel weights, up to 256 rows scalar ones and a rescale,
kernels/fp8_rescale.py; 1x128 activation blocks against 128x128 weight blocks where torch and cuBLAS >= 12.9
support it); otherwise our Triton kernel, which takes either scaling, splits K
over more programs for small batches (partial sums in float32, added in a fixed order) and loads its first weight
tile before the PDL wait. All are CUDA-graph safe (no host syncs). The Triton kernels also run under
``TRITON_INTERPRET=1`` on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fp8_gemv, fp8_rescale
from kernels.device import num_sms
from kernels.fp8_quant import quantize_rows
from kernels.pdl import pdl_enter, use_pdl
from kernels.scaled_mm import block_scaled_mm, scaled_mm, uses_scaled_mm
from kernels.split_sums import sum_splits

SMALL_M = 16  # up to this many rows our Triton kernel splits K (small batches)
# rows the GEMV takes: on an H200 (Qwen3-8B layers, per step) it takes 3.2 ms at one row against cuBLASLt's 4.6, but
# its multiply-adds grow with the rows: 7.1 ms at two rows against 4.7, 13.2 at four against 4.7 (block scales 3.6)
GEMV_ROWS = 1


# M unspecialized: a new row count does not recompile. k_per_split (a multiple of BLOCK_K) specialized: 16-byte loads
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_xs_m,
    stride_xs_g,
    stride_ws_n,
    stride_ws_g,
    stride_om,
    stride_os,  # between the splits' partial sums (0 with one split)
    BLOCK_SCALES: tl.constexpr,  # scales per (row, K group) and per GROUP_N x GROUP_K block; else per row / column
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    # weights: written by no kernel of the step, so the first tile is in flight during the wait
    w = tl.load(w_ptrs, mask=mask_n[:, None] & ((k_start + offs_k) < k_end)[None, :], other=0.0)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None] & ((k + offs_k) < k_end)[None, :], other=0.0)
        prod = tl.dot(x, tl.trans(w))
        if BLOCK_SCALES:
            g = k // GROUP_K
            sx = tl.load(xs_ptr + offs_m * stride_xs_m + g * stride_xs_g, mask=mask_m, other=0.0)
            sw = tl.load(ws_ptr + (offs_n // GROUP_N) * stride_ws_n + g * stride_ws_g, mask=mask_n, other=0.0)
            acc += prod * sx[:, None] * sw[None, :]
        else:
            acc += prod
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=mask_n[:, None] & ((k + BLOCK_K + offs_k) < k_end)[None, :], other=0.0)
    if not BLOCK_SCALES:  # the scales are linear, so each split may apply them to its partial sum
        sx = tl.load(xs_ptr + offs_m * stride_xs_m, mask=mask_m, other=0.0)
        sw = tl.load(ws_ptr + offs_n * stride_ws_n, mask=mask_n, other=0.0)
        acc = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS and SPLIT_K == 1:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Splits of K that give decode-sized products about two programs per SM, keeping >= 512 columns a split."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split, sms = 1, num_sms(device, cpu=4)
    while tiles * split < 2 * sms and k // (2 * split) >= max(512, block_k) and split < 16:
        split *= 2
    return split


def fp8_gemm(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """Our Triton FP8 GEMM: ``out = (x_q * x_s) @ (w_q * w_s).T (+ bias)``. Scales: per row [M, 1] and per output
    channel [N] (``block`` None), or per (row, K group) [M, K / block[1]] and per weight block. ``tiles``: (BLOCK_M,
    BLOCK_N, warps, stages, K splits) instead of the built-in choice (benchmarks/fp8_gemm.py sweeps them)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    cuda = x_q.is_cuda
    block_k = 128 if block is None else min(128, block[1])
    if tiles is not None:
        block_m, block_n, warps, stages, split = tiles
    elif m <= SMALL_M:
        block_m, block_n, warps, stages = 16, (64 if cuda else 32), 4, 3
        split = _split_k(m, n, k, block_m, block_n, block_k, x_q.device)
    else:
        block_m, block_n, warps, stages, split = (64 if m <= 64 else 128), 128, (4 if m <= 64 else 8), 3, 1
    if not cuda:
        block_m, block_n, warps, stages = 16, 32, 1, 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x_q.device)
    w_s2 = w_s.view(-1, 1) if block is None else w_s
    pdl = use_pdl(x_q)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _fp8_gemm_kernel[grid](
        x_q,
        w_q,
        x_s,
        w_s2,
        bias if bias is not None else out,
        part,
        m,
        n,
        k,
        k_per_split,
        x_q.stride(0),
        w_q.stride(0),
        x_s.stride(0),
        x_s.stride(1),
        w_s2.stride(0),
        w_s2.stride(1),
        part.stride(-2),
        m * n if split > 1 else 0,
        BLOCK_SCALES=block is not None,
        GROUP_N=1 if block is None else block[0],
        GROUP_K=block_k if block is None else block[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        HAS_BIAS=bias is not None,
        USE_PDL=pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=pdl,
    )
    if split > 1:
        sum_splits(part, bias, out)
    return out


def quantized_linear(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """``fp8_linear``'s cuBLASLt product of already quantized rows (``x_q`` e4m3 [M, K], scales [M, 1]) and a
    per-channel weight, into ``out``: scalar scales and a rescale up to fp8_rescale.MAX_ROWS rows, else rowwise."""
    if fp8_rescale.applies(x_q.shape[0]):
        return fp8_rescale.scalar_scaled_linear(x_q, x_s, w_q, w_s, bias, out)
    scaled_mm(x_q, x_s, w_q, w_s, None, None, out)  # bias after: not every build's rowwise path takes one
    return out if bias is None else out.add_(bias)


def fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for an FP8 weight: ``x`` [M, K] quantized per token (``block`` None, weight scales per
    output channel [N]) or per token and ``block[1]`` columns (weight scales per block); into ``out`` when given."""
    m, k = x.shape
    n = w_q.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if m <= GEMV_ROWS and fp8_gemv.supports(m, k, block):
        return fp8_gemv.fp8_gemv(x, w_q, w_s, block, bias, out)
    if uses_scaled_mm(n, k, block, x.device):
        if block is not None:
            return block_scaled_mm(x, w_q, w_s, block, bias, out)
        return quantized_linear(*quantize_rows(x, None), w_q, w_s, bias, out)
    x_q, x_s = quantize_rows(x, None if block is None else block[1])
    return fp8_gemm(x_q, x_s, w_q, w_s, block, bias, out)
