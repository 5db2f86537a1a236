"""``x @ w.T`` for decode batches of a few rows, where cuBLAS leaves most of the GPU idle.

At batch 1-16 a linear layer is a read of its weight. For narrow outputs (Qwen3-0.6B's o_proj and down_proj,
1,024 columns) cuBLAS runs few programs and spends 6-13 us on 4-6 MB of weights; splitting K over four times
more programs takes 4.5-5.5 us (benchmarks/decode_gemm.py, docs/PERF.md log 7). The kernel is launched with PDL
(kernels/pdl.py) and loads its first weight tile, which no kernel of the step writes, before waiting on the
kernel in front of it.

Each split writes its fp32 partial sums to a workspace; a second launch adds them in a fixed order, so results
do not vary from run to run. ``decode_linear_tiles`` decides which shapes take this path; the rest use cuBLAS.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, use_pdl

MAX_ROWS = 16  # tl.dot's smallest M; more rows go to cuBLAS
DISABLE_ENV = "NANOSERVE_DISABLE_DECODE_GEMM"  # "1": cuBLAS for every shape (A/B runs)
_DISABLED = os.environ.get(DISABLE_ENV) == "1"


@triton.jit(do_not_specialize=["M"])
def _split_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,  # between the splits' partial results (0 when SPLIT_K == 1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    k_per_split = K // SPLIT_K  # the host checks K % (SPLIT_K * BLOCK_K) == 0 and N % BLOCK_N == 0
    k0 = pid_k * k_per_split
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
    w = tl.load(w_ptrs)  # weights: written by no kernel of the step, so in flight during the wait
    pdl_enter(USE_PDL)
    x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
    acc = tl.dot(x, tl.trans(w), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
    for k in range(BLOCK_K, k_per_split, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs + k)
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def decode_linear_tiles(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) when ``x @ w.T`` should take this kernel, else None (cuBLAS).

    From the H200 sweeps (benchmarks/decode_gemm.py): narrow outputs at <= 16 rows (0.6B o/down: 0.35-0.8x
    cuBLAS's time), and single-row products with K >= 2048 (8B o/down, and the TP=2 shards: 0.9x). Wide
    outputs (gate_up, the 0.6B and 8B qkv) stay with cuBLAS, which matches or beats us there.
    """
    if _DISABLED or not (
        x.is_cuda and x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16) and w.dtype == x.dtype
    ):
        return None
    m, k = x.shape
    n = w.shape[0]
    if not (0 < m <= MAX_ROWS and x.stride(1) == 1 and w.is_contiguous()):
        return None
    if n <= 2048 and n % 64 == 0 and k % 512 == 0:
        return (32 if m == 1 else 64), 128, 4, 4, 3
    if m == 1 and n <= 4096 and n % 64 == 0 and k >= 2048 and k % 512 == 0:
        return 64, 128, 4, 4, 3
    return None


def decode_linear(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int, int]) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [M <= 16, K] and a contiguous ``w`` [N, K] with the given tiles."""
    block_n, block_k, split_k, warps, stages = tiles
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_ROWS and n % block_n == 0 and k % (split_k * block_k) == 0, (x.shape, w.shape, tiles)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    pdl = use_pdl(x)
    part = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _split_gemm_kernel[(n // block_n, split_k)](
        x,
        w,
        part,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        n,
        m * n if split_k > 1 else 0,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        USE_PDL=pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=pdl,
    )
    if split_k > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](
            part, out, m * n, SPLIT_K=split_k, BLOCK=1024, USE_PDL=pdl, num_warps=4, launch_pdl=pdl
        )
    return out
