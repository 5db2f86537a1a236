"""The sum of a split-K product's float32 partials ``part`` [splits, M, N] (+ bias) into ``out`` [M, N], in a
fixed order, so a split product repeats bit for bit. A PDL launch: it waits for the split kernel before it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, use_pdl


@triton.jit
def _sum_splits_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    N,
    stride_ps,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(part_ptr + row * N + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + row * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out = part.sum(0) (+ bias)`` for contiguous float32 ``part`` [splits, M, N], summed split by split."""
    split, m, n = part.shape
    assert part.is_contiguous() and out.stride(1) == 1
    block = min(1024, triton.next_power_of_2(n))
    pdl = use_pdl(part)
    _sum_splits_kernel[(m, triton.cdiv(n, block))](
        part,
        bias if bias is not None else out,
        out,
        n,
        m * n,
        out.stride(0),
        SPLIT_K=split,
        BLOCK=block,
        HAS_BIAS=bias is not None,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
