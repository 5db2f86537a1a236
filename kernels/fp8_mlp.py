"""An FP8 gated MLP (per-channel weights) at more rows than the GEMV takes: gate/up as a scalar-scaled product, then
one kernel that applies the token and channel scales, takes silu(gate) * up and quantizes that per token for the
down product.

Unfused, the same MLP runs the rescale (up to fp8_rescale.MAX_ROWS rows), SiLU-and-mul and the down input's
quantization as three launches with two extra passes over [M, 2N] and [M, N]; and above that its gate/up takes
cuBLASLt's one rowwise-scaled algorithm, because a separate rescale would cost more than the scalar product saves
(docs/PERFORMANCE_LOG.md log 23c). Here the scales ride on a pass that happens anyway. The kernel rounds where the
unfused kernels store 16-bit values (the rescaled gate and up, the SiLU, the product), so both paths give the same
bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fp8_rescale
from kernels.fp8_gemm import GEMV_ROWS, quantized_linear
from kernels.fp8_quant import FP8_MAX, MIN_AMAX, quantize_rows
from kernels.pdl import pdl_enter, use_pdl
from kernels.scaled_mm import unscaled_mm, uses_scaled_mm
from protocol.settings import settings

_BLOCK = 16384  # activation columns a program holds at once (Qwen3-8B's 12,288: the whole row, one pass)
# from this many rows (prefill), two passes over 2,048-column slices in 8 warps: 321 -> 258 us at 8,192 rows of
# Qwen3-8B, where the whole row in 16 warps leaves too few programs per SM to hide the loads (log 34); up to 256
# rows the whole row stays fastest
_MANY_ROWS, _MANY_ROWS_BLOCK = 1024, 2048
_ENABLED = settings().fp8_fused_mlp  # NANOSERVE_FP8_FUSED_MLP=0: the unfused kernels


@triton.jit
def _scaled_silu_mul(y_row, xs, ws_ptr, bias_ptr, offs, mask, N, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
    """silu(gate) * up for columns ``offs`` of one row of the unscaled product ``y_row`` [2N] (``SCALED`` False: a
    finished gate/up output, no scales), rounded as the unfused kernels store it."""
    dtype = y_row.dtype.element_ty
    gate = tl.load(y_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_row + N + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        gate *= xs * tl.load(ws_ptr + offs, mask=mask)
        up *= xs * tl.load(ws_ptr + N + offs, mask=mask)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + N + offs, mask=mask, other=0.0).to(tl.float32)
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@triton.jit  # N specialized: its divisibility by 16 vectorizes the loads and stores (scalar ones when it was not)
def _silu_mul_quant_kernel(
    y_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    q_ptr,
    s_ptr,
    N,
    stride_y,
    stride_q,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_STEP: tl.constexpr,  # BLOCK covers N: the row stays in registers between its amax and its quantization
    USE_PDL: tl.constexpr,
):
    # One program a row: its amax, then the row quantized by it (computed again, from cache, past one step).
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_y
    q_row = q_ptr + row * stride_q
    xs = 1.0
    if SCALED:
        xs = tl.load(xs_ptr + row)
    offs = tl.arange(0, BLOCK)
    if ONE_STEP:
        act = _scaled_silu_mul(y_row, xs, ws_ptr, bias_ptr, offs, offs < N, N, HAS_BIAS, SCALED)
        amax = tl.max(tl.abs(act), axis=0)
    else:
        amax = 0.0
        for c0 in range(0, N, BLOCK):
            act = _scaled_silu_mul(y_row, xs, ws_ptr, bias_ptr, c0 + offs, c0 + offs < N, N, HAS_BIAS, SCALED)
            amax = tl.maximum(amax, tl.max(tl.abs(act), axis=0))
    scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)
    tl.store(s_ptr + row, scale)
    inv = tl.math.div_rn(1.0, scale)
    if ONE_STEP:
        tl.store(q_row + offs, tl.clamp(act * inv, -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty), mask=offs < N)
    else:
        for c0 in range(0, N, BLOCK):
            act = _scaled_silu_mul(y_row, xs, ws_ptr, bias_ptr, c0 + offs, c0 + offs < N, N, HAS_BIAS, SCALED)
            q = tl.clamp(act * inv, -FP8_MAX, FP8_MAX)
            tl.store(q_row + c0 + offs, q.to(q_ptr.dtype.element_ty), mask=c0 + offs < N)


def _tiling(y: torch.Tensor, n: int) -> tuple[int, int]:
    """(columns a program takes at once, warps) for ``y``'s rows of ``n`` output columns; the tests' interpreter
    takes the multi-step path past 2,048 columns."""
    if not y.is_cuda:
        return min(2048, triton.next_power_of_2(n)), 1
    if y.shape[0] >= _MANY_ROWS:
        return min(_MANY_ROWS_BLOCK, triton.next_power_of_2(n)), 8
    block = min(_BLOCK, triton.next_power_of_2(n))
    if y.shape[0] == 1 and block == _BLOCK:  # one row: the step waits on this one program (W2 FP8 -0.6%)
        return block, 32
    return block, max(4, min(16, block // 1024))


def silu_mul_quant(
    y: torch.Tensor,
    x_s: torch.Tensor | None = None,
    w_s: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` [M, 2N], a gate/up product computed without its scales (``x_s`` [M] per token, ``w_s`` [2N] per
    channel, then ``bias``; both None: ``y`` is the finished product) -> e4m3 silu(gate) * up [M, N] and its
    per-token scales [M, 1]."""
    m, n = y.shape[0], y.shape[1] // 2
    scaled = x_s is not None
    assert y.stride(1) == 1 and (not scaled or (x_s.numel() == m and w_s.numel() == 2 * n))
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=y.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=y.device)
    if m == 0:
        return q, scales
    pdl = use_pdl(y)
    block, warps = _tiling(y, n)
    _silu_mul_quant_kernel[(m,)](
        y,
        x_s if scaled else scales,
        w_s if scaled else scales,
        y if bias is None else bias,
        q,
        scales,
        n,
        y.stride(0),
        q.stride(0),
        HAS_BIAS=bias is not None,
        SCALED=scaled,
        BLOCK=block,
        ONE_STEP=block >= n,
        USE_PDL=pdl,
        num_warps=warps,
        launch_pdl=pdl,
    )
    return q, scales


def applies(m: int, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether an ``m``-row MLP of these per-channel e4m3 weights (gate/up [2N, K], down [H, N]) takes this path."""
    n2, k = gate_up.shape
    return (
        _ENABLED
        and fp8_rescale.ENABLED
        and m > GEMV_ROWS
        and uses_scaled_mm(n2, k, None, gate_up.device)
        and uses_scaled_mm(down.shape[0], down.shape[1], None, down.device)
    )


def fp8_gated_mlp(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    out: torch.Tensor | None = None,
    x_scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for ``x`` [M, K] with (e4m3 weight, per-channel scales, bias) for the merged
    gate/up and the down layer; into ``out`` when given. ``x_scales`` [M]: ``x`` is already e4m3, quantized per
    token with these scales (by the norm in front), and ``dtype`` the 16-bit dtype of the products. Only where
    ``applies``."""
    w_gu, s_gu, b_gu = gate_up
    x_q, x_s = quantize_rows(x, None) if x_scales is None else (x, x_scales)
    dtype = dtype or x.dtype
    y = torch.empty((x.shape[0], w_gu.shape[0]), dtype=dtype, device=x.device)
    unscaled_mm(x_q, w_gu, y)
    a_q, a_s = silu_mul_quant(y, x_s, s_gu, b_gu)
    if out is None:
        out = torch.empty((x.shape[0], down[0].shape[0]), dtype=dtype, device=x.device)
    return quantized_linear(a_q, a_s, *down, out)
