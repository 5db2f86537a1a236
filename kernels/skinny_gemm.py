"""``x @ w.T`` for a few rows of ``x`` (decode at batch <= 16): a pure weight stream.

At batch 1 a linear layer is a read of its weight matrix; cuBLAS picks split-K kernels for these shapes and
reaches 3.1-3.6 TB/s plus a separate reduction launch on an H200 (Qwen3-8B o_proj / qkv / down at batch 1;
docs/PERF.md). Here each program owns ``BLOCK_N`` output columns and streams their whole rows of ``w`` through
a deep pipeline; the rows of ``x`` (padded to 16 for ``tl.dot``) ride along. No reduction pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # tl.dot's smallest M; more rows go to cuBLAS


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            mask_k = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [M <= 16, K] and ``w`` [N, K] (fp16/bf16, unit stride along K).

    ``tiles`` = (BLOCK_N, BLOCK_K, warps, stages) overrides the default (benchmarks/skinny_gemm.py sweeps them).
    """
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_ROWS and w.shape[1] == k and x.stride(-1) == 1 and w.stride(-1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, num_warps, num_stages = tiles or default_tiles(n, k, x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def default_tiles(n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        return 16, 32, 1, 1  # interpreter: small tiles keep CPU tests fast
    return 32, 256, 4, 4
