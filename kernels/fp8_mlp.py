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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import GEMV_ROWS, quantized_linear
from kernels.fp8_quant import FP8_MAX, MIN_AMAX, quantize_rows
from kernels.pdl import pdl_enter, use_pdl
from kernels.scaled_mm import unscaled_mm, uses_scaled_mm

# a one-row program's columns at once (32 warps); more rows take a Qwen3-8B row (12,288) in one pass as 8,192 + 4,096
# columns in 16 warps (52 registers, 2 programs an SM; a 16,384-column block took 98, one program an SM): 256 rows
# 15.0 -> 11.7 us, 8,192 rows (prefill) 256 -> 212 us against two passes over 2,048-column slices
_BLOCK = 16384


@triton.jit
def _scaled_silu_mul(y_rows, xs, ws_ptr, bias_ptr, cols, row_mask, N, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
    """silu(gate) * up at columns ``cols`` [1, C] of the rows ``y_rows`` [R, 1] of the unscaled product (rows of 2N;
    ``xs`` [R, 1]; ``SCALED`` False: a finished gate/up output, no scales), rounded as the unfused kernels store it."""
    dtype = y_rows.dtype.element_ty
    col_mask = cols < N
    mask = row_mask & col_mask
    gate = tl.load(y_rows + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_rows + N + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:  # loaded once for the program's rows
        gate *= xs * tl.load(ws_ptr + cols, mask=col_mask)
        up *= xs * tl.load(ws_ptr + N + cols, mask=col_mask)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@triton.jit
def _store_quantized(q_rows, act, inv, cols, row_mask, N):
    q = tl.clamp(act * inv, -FP8_MAX, FP8_MAX)
    tl.store(q_rows + cols, q.to(q_rows.dtype.element_ty), mask=row_mask & (cols < N))


@triton.jit  # N specialized: its divisibility by 16 vectorizes the loads and stores (scalar ones when it was not)
def _silu_mul_quant_kernel(
    y_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    q_ptr,
    s_ptr,
    M,
    N,
    stride_y,
    stride_q,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    ROWS: tl.constexpr,  # rows a program: each channel scale loaded once for all of them
    BLOCK: tl.constexpr,
    TAIL: tl.constexpr,  # 0, or the power of two past BLOCK that holds the rest of the row (N - BLOCK)
    ONE_STEP: tl.constexpr,  # BLOCK + TAIL covers N: the rows stay in registers between their amax and quantization
    USE_PDL: tl.constexpr,
):
    # ROWS rows a program: their amax, then each row quantized by its own (computed again, from cache, when the
    # row takes several BLOCK steps).
    pdl_enter(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = (rows < M)[:, None]
    y_rows = y_ptr + rows[:, None] * stride_y
    q_rows = q_ptr + rows[:, None] * stride_q
    xs = 1.0  # unread unless SCALED
    if SCALED:
        xs = tl.load(xs_ptr + rows, mask=rows < M, other=1.0)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    if ONE_STEP:
        act = _scaled_silu_mul(y_rows, xs, ws_ptr, bias_ptr, cols, row_mask, N, HAS_BIAS, SCALED)
        amax = tl.max(tl.abs(act), axis=1)
        if TAIL > 0:  # a row that is not a power of two wide, in two power-of-two pieces: no masked quarter
            tail_cols = BLOCK + tl.arange(0, TAIL)[None, :]
            tail = _scaled_silu_mul(y_rows, xs, ws_ptr, bias_ptr, tail_cols, row_mask, N, HAS_BIAS, SCALED)
            amax = tl.maximum(amax, tl.max(tl.abs(tail), axis=1))
    else:
        amax = tl.zeros((ROWS,), tl.float32)
        for c0 in range(0, N, BLOCK):
            act = _scaled_silu_mul(y_rows, xs, ws_ptr, bias_ptr, c0 + cols, row_mask, N, HAS_BIAS, SCALED)
            amax = tl.maximum(amax, tl.max(tl.abs(act), axis=1))
    scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)
    tl.store(s_ptr + rows, scale, mask=rows < M)
    inv = tl.math.div_rn(1.0, scale)[:, None]
    if ONE_STEP:
        _store_quantized(q_rows, act, inv, cols, row_mask, N)
        if TAIL > 0:
            _store_quantized(q_rows, tail, inv, tail_cols, row_mask, N)
    else:
        for c0 in range(0, N, BLOCK):
            act = _scaled_silu_mul(y_rows, xs, ws_ptr, bias_ptr, c0 + cols, row_mask, N, HAS_BIAS, SCALED)
            _store_quantized(q_rows, act, inv, c0 + cols, row_mask, N)


@dataclass(frozen=True, slots=True)
class Tiling:
    """How ``_silu_mul_quant_kernel`` takes an [M, N] middle: ``rows`` a program, ``block`` (+ ``tail``) columns at
    once, ``warps``."""

    block: int
    tail: int = 0
    rows: int = 1
    warps: int = 4


def whole_row(n: int, rows: int, warps: int, cap: int = _BLOCK) -> Tiling:
    """The row in registers as the largest power of two <= ``n`` (at most ``cap``) and a power-of-two rest, where
    that covers it; else ``cap``-column steps."""
    block = min(cap, 1 << (n.bit_length() - 1))
    rest = n - block
    if rest > block:
        return Tiling(block, 0, rows, warps)
    return Tiling(block, triton.next_power_of_2(rest) if rest else 0, rows, warps)


def default_tiling(m: int, n: int, on_gpu: bool) -> Tiling:
    """The engine's tiling for ``m`` rows of ``n`` columns; the tests' interpreter takes 2,048 columns at once."""
    if not on_gpu:
        return whole_row(n, 1, 1, cap=2048)
    if m == 1 and triton.next_power_of_2(n) >= _BLOCK:  # one row: the step waits on this one program (W2 FP8 -0.6%)
        return Tiling(_BLOCK, 0, 1, 32)
    return whole_row(n, 1, max(4, min(16, triton.next_power_of_2(n) // 1024)), cap=_BLOCK // 2)


def launch(
    y: torch.Tensor,
    x_s: torch.Tensor | None,
    w_s: torch.Tensor | None,
    bias: torch.Tensor | None,
    q: torch.Tensor,
    scales: torch.Tensor,
    tiling: Tiling,
) -> None:
    """The kernel on ``y`` [M, 2N] into ``q`` [M, N] and ``scales`` [M, 1] (see ``silu_mul_quant``)."""
    m, n = q.shape
    pdl = use_pdl(y)
    _silu_mul_quant_kernel[(triton.cdiv(m, tiling.rows),)](
        y,
        scales if x_s is None else x_s,
        scales if w_s is None else w_s,
        y if bias is None else bias,
        q,
        scales,
        m,
        n,
        y.stride(0),
        q.stride(0),
        HAS_BIAS=bias is not None,
        SCALED=x_s is not None,
        ROWS=tiling.rows,
        BLOCK=tiling.block,
        TAIL=tiling.tail,
        ONE_STEP=tiling.block + tiling.tail >= n,
        USE_PDL=pdl,
        num_warps=tiling.warps,
        launch_pdl=pdl,
    )


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
    launch(y, x_s, w_s, bias, q, scales, default_tiling(m, n, y.is_cuda))
    return q, scales


def applies(m: int, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether an ``m``-row MLP of these per-channel e4m3 weights (gate/up [2N, K], down [H, N]) takes this path."""
    n2, k = gate_up.shape
    return (
        m > GEMV_ROWS
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
