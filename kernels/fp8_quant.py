"""Dynamic activation quantization to e4m3 on the GPU: one Triton pass per row, one scale per token or per token
and ``group`` columns (block-FP8 checkpoints), the arithmetic of model/fp8.py (scale = amax / 448 and its
reciprocal, each correctly rounded; the values times the reciprocal, saturated at 448). Scales are written
group-major ([groups, M], returned as its [M, groups] transpose), the layout cuBLASLt's block scaling reads. Also
runs under ``TRITON_INTERPRET=1`` on CPU tensors."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, use_pdl

FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-10)  # an all-zero group gets a tiny scale, not a division by zero (model/fp8.py's)
_MAX_ROW_BLOCK = 16384  # columns one program holds at once


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_qm,
    stride_sg,  # between groups of the scales ([groups, M])
    GROUP: tl.constexpr,  # columns per scale; 0 = the whole row
    BLOCK: tl.constexpr,  # columns per program (a multiple of GROUP), or per chunk of a whole row
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if GROUP == 0:
        # one scale per row: the amax of the whole row first, then the quantization (a second read, from cache)
        amax = 0.0
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)
        tl.store(s_ptr + row, scale)
        inv = tl.math.div_rn(1.0, scale)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(x * inv, -FP8_MAX, FP8_MAX)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        xg = tl.reshape(x, (BLOCK // GROUP, GROUP))
        amax = tl.max(tl.abs(xg), axis=1)
        scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)
        # zeros either way; a zero reciprocal for an all-zero group (the groups past K), as kernels/fp8_gemv.py does
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full([BLOCK // GROUP], 1.0, tl.float32), scale), 0.0)
        q = tl.clamp(xg * inv[:, None], -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=offs < K)
        g = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + g * stride_sg + row, scale, mask=g * GROUP < K)


def quantize_rows(x: torch.Tensor, group: int | None, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] 16-bit (or float32) -> (e4m3 [R, K], float32 scales [R, ceil(K / group)] with R the unit-stride dim);
    ``group`` None: one scale per row. ``rows`` R >= M (default M): the rows after x's are zeros with scale 1."""
    m, k = x.shape
    rows = m if rows is None else rows
    assert x.stride(1) == 1 and rows >= m
    groups = 1 if group is None else triton.cdiv(k, group)
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((groups, rows), dtype=torch.float32, device=x.device)
    scales_view = scales.view(rows, 1) if group is None else scales.t()  # [R, 1] contiguous: torch's rowwise check
    if rows > m:
        q[m:].view(torch.uint8).zero_()  # e4m3's +0.0, through a dtype every fill kernel takes
        scales[:, m:].fill_(1.0)
    if m == 0:
        return q, scales_view
    pdl = use_pdl(x)
    if group is None:
        block, chunks = min(_MAX_ROW_BLOCK, triton.next_power_of_2(k)), 1
    else:
        assert group & (group - 1) == 0, "activation groups are powers of two"
        block = max(group, min(_MAX_ROW_BLOCK, triton.next_power_of_2(k)))
        chunks = triton.cdiv(k, block)
    warps = 4 if not x.is_cuda else max(4, min(16, block // 1024))
    _quant_rows_kernel[(m, chunks)](
        x,
        q,
        scales,
        k,
        x.stride(0),
        q.stride(0),
        rows,
        GROUP=group or 0,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=warps,
        launch_pdl=pdl,
    )
    return q, scales_view
