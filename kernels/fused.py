"""Fused Triton kernels for the elementwise chains around the matmuls: residual-add + RMSNorm (which may also
quantize its rows for FP8 products) and SiLU-and-mul; per-head q/k RMSNorm + RoPE is kernels/qk_norm_rope.py. In
eager torch each chain is 5-20 tiny kernels per layer; at decode batch sizes those launches, not the bytes, set the
step time (measured: ~1,400 kernels, 3.3 ms per Qwen3-0.6B step).

Rounding follows HF's Qwen3 (the oracle): the residual sum is rounded to the model dtype, the norm runs in
float32, is rounded to the model dtype and then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8_MAX, MIN_AMAX
from kernels.fp8_rescale import Unscaled
from kernels.pdl import pdl_enter, use_pdl


@triton.jit
def rms_normalized(x, N, eps):
    """One row (padding columns zero) divided by its root mean square and rounded to ``x``'s dtype, as HF's RMSNorm
    rounds it before the weight; in float32."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    return (xf * rstd).to(x.dtype).to(tl.float32)


@triton.jit
def residual_added(x, res_ptrs, sum_ptrs, mask, keep):
    """``x`` plus the residual at ``res_ptrs``, added in float32 and rounded to ``x``'s dtype as HF adds them;
    stored at ``sum_ptrs`` where ``keep`` (the one program of a row that writes the new residual)."""
    x = (x.to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    if keep:
        tl.store(sum_ptrs, x, mask=mask)
    return x


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,  # QUANTIZE: the rows' per-token scales; else unused
    xs_ptr,  # SCALED: x is an FP8 product before its scales, per row [M] and per column [N]; else unused
    ws_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,  # out is e4m3: the 16-bit result quantized per token, as kernels/fp8_gemv.py would
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # weights: in flight during the wait
    if SCALED:
        ws = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if SCALED:  # kernels/fp8_rescale.py's arithmetic and rounding
        x = (x.to(tl.float32) * (tl.load(xs_ptr + row) * ws)).to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        x = residual_added(x, res_ptr + row * stride_r + offs, res_out_ptr + row * stride_ro + offs, mask, True)
    y = rms_normalized(x, N, eps)
    y = y * w.to(tl.float32)
    if QUANTIZE:
        y = y.to(x.dtype).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX), FP8_MAX)
        tl.store(scale_ptr + row, scale)
        y = tl.clamp(y * tl.math.div_rn(1.0, scale), -FP8_MAX, FP8_MAX)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of a 2-D ``x``; with ``residual``, returns (norm(x + residual), x + residual)."""
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    _rmsnorm(x, weight, eps, residual, out, res_out, None)
    return out if residual is None else (out, res_out)


def rmsnorm_quantized(
    x: torch.Tensor | Unscaled, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 norm(x + residual) [M, K], its per-token scales [M], x + residual): ``rmsnorm``'s rows quantized as
    kernels/fp8_gemv.py quantizes a 16-bit row, so a GEMV behind it skips that work in each of its programs.
    ``x`` may be an FP8 product before its scales (the norm applies them); ``residual`` None: x itself is the new
    residual (the first layer's embedding)."""
    unscaled = x if isinstance(x, Unscaled) else None
    assert residual is not None or unscaled is None, "an unscaled product is not a residual"
    x = x.raw if unscaled is not None else x
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    _rmsnorm(x, weight, eps, residual, q, res_out, scales, unscaled)
    return q, scales, res_out


def _rmsnorm(x, weight, eps, residual, out, res_out, scales, unscaled: Unscaled | None = None) -> None:
    n = x.shape[-1]
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    pdl = use_pdl(x)
    _rmsnorm_kernel[(x.shape[0],)](
        x,
        res,
        weight,
        out,
        res_out,
        scales if scales is not None else weight,
        weight if unscaled is None else unscaled.x_s,
        weight if unscaled is None else unscaled.w_s,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        QUANTIZE=scales is not None,
        SCALED=unscaled is not None,
        BLOCK=block,
        USE_PDL=pdl,
        # 16 warps from 4,096 columns: 8 values a thread shorten the chain through the row's two reductions (W1
        # Qwen3-8B FP8 +0.2-0.5%; W1 bf16 and W2 unchanged)
        num_warps=4 if block <= 2048 else 16,
        launch_pdl=pdl,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :N]) * x[:, N:] for a 2-D ``x`` of width 2N."""
    n = x.shape[-1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    pdl = use_pdl(x)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, USE_PDL=pdl, launch_pdl=pdl
    )
    return out
