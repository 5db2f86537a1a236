"""``x @ w.T`` for decode batches of a few rows, where cuBLAS leaves most of the GPU idle.

At batch 1-16 a linear layer is a read of its weight. For narrow outputs (Qwen3-0.6B's o_proj and down_proj,
1,024 columns) cuBLAS runs few programs and spends 6-13 us on 4-6 MB of weights; splitting K over four times
more programs takes 4.5-5.5 us (benchmarks/decode_gemm.py, H200). The kernel is launched with PDL
(kernels/pdl.py) and loads its first weight tile, which no kernel of the step writes, before waiting on the
kernel in front of it.

One or two rows (W2, a small batch) take a GEMV kernel instead: each program multiplies one 16 KB weight slice,
loaded whole before the wait, by each row and sums along K; so every program resident while the kernel in front
still runs has its weight in flight (8B qkv/o/gate_up at one row: 0.83-0.96x cuBLAS's time).

Each split writes its fp32 partial sums to a workspace; a second launch adds them in a fixed order, so results
do not vary from run to run. ``decode_linear_tiles`` decides which shapes take this path; the rest use cuBLAS.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fused import residual_added, rms_normalized
from kernels.pdl import pdl_enter, use_pdl

MAX_ROWS = 16  # tl.dot's smallest M; more rows go to cuBLAS
GEMV_MAX_ROWS = 8  # the GEMV kernel unrolls its rows
_GEMV_SLICE = 8192  # weight elements per GEMV program (16 KB in bf16): the best of 8-32 KB on an H200
# A GEMV that takes the add + RMSNorm in front of it norms the row in every program: programs x K past this cost
# more than the norm's own launch (H200, W2: Qwen3-30B-A3B's qkv, 1,280 x 2,048, -1.4%; Qwen3-8B's qkv and gate/up,
# 3,072 and 12,288 x 4,096, +3.1%)
NORM_ROW_READS = 1 << 22


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


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    res_ptr,  # ADD_NORM: the residual stream, its sum with x (res_out_ptr) and the norm's weight; else unused
    res_out_ptr,
    norm_w_ptr,
    eps,
    M,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,  # between the splits' partial results (0 when there is one split)
    ROWS: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the whole slice: BLOCK_K * splits == K
    ADD_NORM: tl.constexpr,  # multiply RMSNorm(x + residual), as kernels/fused.py's rmsnorm rounds it (one split)
    USE_PDL: tl.constexpr,
):
    # A few rows: per row a multiply and a sum along K, no tensor cores, so a slice may be a few weight rows tall.
    # The program's whole weight slice is loaded before the wait: every program resident while the kernel in
    # front runs has its share of the weight in flight.
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :])
    if ADD_NORM:
        g = tl.load(norm_w_ptr + offs_k).to(tl.float32)
    pdl_enter(USE_PDL)
    w = w.to(tl.float32)
    out = out_ptr + pid_k * stride_os + offs_n
    for r in tl.static_range(ROWS):
        # row masks as tensors: the interpreter mis-types a scalar bool broadcast into a mask
        row_k = (offs_k * 0 + r) < M
        x = tl.load(x_ptr + r * stride_xm + offs_k, mask=row_k, other=0.0)
        if ADD_NORM:
            # Every program norms the whole row itself (a few KB from L2), which saves the norm's own launch;
            # the first keeps the sum, into a buffer no program reads.
            x = residual_added(x, res_ptr + r * BLOCK_K + offs_k, res_out_ptr + r * BLOCK_K + offs_k, row_k, pid_n == 0)
            x = (rms_normalized(x, BLOCK_K, eps) * g).to(x.dtype)
        acc = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
        tl.store(out + r * stride_om, acc.to(out_ptr.dtype.element_ty), mask=(offs_n * 0 + r) < M)


@triton.jit  # numel (rows x a multiple of 64 columns) specialized: its divisibility vectorizes the sums' accesses
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class Tiles(NamedTuple):
    """How one decode GEMM is cut: output columns per program, K per inner step, K splits, warps, pipeline
    stages; ``gemv``: the GEMV kernel (multiply and sum per row, whole slices) instead of ``tl.dot``."""

    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int
    gemv: bool = False


def decode_linear_tiles(x: torch.Tensor, w: torch.Tensor) -> Tiles | None:
    """The tiles when ``x @ w.T`` should take one of our kernels, else None (cuBLAS).

    From the H200 sweeps of benchmarks/decode_gemm.py:
    - the GEMV kernel, 16 KB of weight per program loaded before the PDL wait, for K <= 4096 at one or two rows
      (8B qkv/o/gate_up at one row: 0.83-0.96x cuBLAS's time, at two: 0.90-0.98x; 0.6B: 0.22-0.95x) and for
      narrow outputs at up to four rows (0.6B o/down: 0.48-0.92x). Its per-row cost grows with the rows: at
      four rows the wide products take 1.2-1.3x cuBLAS's time, at eight 1.5-2.2x;
    - the same GEMV split into whole slices of 2048-4096 columns for single-row products with K a multiple of
      2048 (Qwen3-8B's and Llama-3.1-8B's down: 28.3 against 29.3 us with split-K);
    - the split-K ``tl.dot`` kernel for narrow outputs at up to 16 rows (0.6B o/down), and for other single-row
      products with K > 4096;
    - cuBLAS for everything else.
    """
    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16) and w.dtype == x.dtype):
        return None
    m, k = x.shape
    n = w.shape[0]
    if not (0 < m <= MAX_ROWS and x.stride(1) == 1 and w.is_contiguous()):
        return None
    narrow = n <= 2048
    long_row = m == 1 and k % 2048 == 0  # 8B down at one row: whole-slice splits beat split-K (W2 -1.6-2.1%)
    if (k <= 4096 or long_row) and k % 64 == 0 and (m <= 2 or (m <= 4 and narrow)):
        block_k = min(4096, k & -k)  # the largest power of two dividing K
        block_n = max(1, _GEMV_SLICE // block_k)
        if n % block_n == 0:
            return Tiles(block_n, block_k, k // block_k, 4, 1, gemv=True)
    if narrow and n % 64 == 0 and k % 512 == 0:
        return Tiles((32 if m == 1 else 64), 128, 4, 4, 3)
    if m == 1 and n <= 4096 and n % 64 == 0 and k >= 2048 and k % 512 == 0:
        return Tiles(64, 128, 4, 4, 3)
    return None


def decode_linear(x: torch.Tensor, w: torch.Tensor, t: Tiles, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [M <= 16, K] and a contiguous ``w`` [N, K] with the given tiles (into a contiguous
    ``out`` [M, N] when given)."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_ROWS and n % t.block_n == 0 and k % (t.split_k * t.block_k) == 0, (x.shape, w.shape, t)
    assert not t.gemv or (m <= GEMV_MAX_ROWS and t.block_k * t.split_k == k), "GEMV: a few rows, whole slices"
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    pdl = use_pdl(x)
    split_k = t.split_k
    part = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    split_stride = m * n if split_k > 1 else 0
    grid = (n // t.block_n, split_k)
    if t.gemv:
        _gemv_kernel[grid](
            x,
            w,
            part,
            x,
            x,
            w,
            0.0,
            m,
            x.stride(0),
            w.stride(0),
            n,
            split_stride,
            ROWS=triton.next_power_of_2(m),
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k,
            ADD_NORM=False,
            USE_PDL=pdl,
            num_warps=t.warps,
            num_stages=t.stages,
            launch_pdl=pdl,
        )
    else:
        _split_gemm_kernel[grid](
            x,
            w,
            part,
            m,
            n,
            k,
            x.stride(0),
            w.stride(0),
            n,
            split_stride,
            BLOCK_M=16,
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k,
            SPLIT_K=split_k,
            USE_PDL=pdl,
            num_warps=t.warps,
            num_stages=t.stages,
            launch_pdl=pdl,
        )
    if split_k > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](
            part, out, m * n, SPLIT_K=split_k, BLOCK=1024, USE_PDL=pdl, num_warps=4, launch_pdl=pdl
        )
    return out


def norm_gemv_tiles(x: torch.Tensor, w: torch.Tensor) -> Tiles | None:
    """The tiles when ``decode_linear_add_norm`` applies: the GEMV with one program per whole row of K, and
    programs x K within NORM_ROW_READS."""
    t = decode_linear_tiles(x, w)
    if t is None or not t.gemv or t.split_k != 1 or not x.is_contiguous():
        return None
    return t if (w.shape[0] // t.block_n) * x.shape[1] <= NORM_ROW_READS else None


def decode_linear_add_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor, t: Tiles
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ w.T, x + residual) in one launch, rounded as kernels/fused.py's rmsnorm followed by
    ``decode_linear``: for ``norm_gemv_tiles``' shapes, where the norm's own launch costs more than every program
    norming the row again."""
    m, k = x.shape
    one_program_a_row = t.gemv and t.split_k == 1 and t.block_k == k and x.is_contiguous() and m <= GEMV_MAX_ROWS
    assert one_program_a_row and residual.shape == x.shape and residual.is_contiguous(), (x.shape, t)
    out = torch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x)
    pdl = use_pdl(x)
    _gemv_kernel[(w.shape[0] // t.block_n, 1)](
        x,
        w,
        out,
        residual,
        res_out,
        norm_weight,
        eps,
        m,
        k,
        w.stride(0),
        out.stride(0),
        0,
        ROWS=triton.next_power_of_2(m),
        BLOCK_N=t.block_n,
        BLOCK_K=k,
        ADD_NORM=True,
        USE_PDL=pdl,
        num_warps=t.warps,
        num_stages=t.stages,
        launch_pdl=pdl,
    )
    return out, res_out
