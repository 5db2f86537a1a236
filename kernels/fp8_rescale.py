"""Per-token x per-channel FP8 products as a scalar-scaled cuBLASLt product and one rescale.

torch._scaled_mm with rowwise scales runs the one cuBLASLt algorithm that takes per-row and per-column scales, and
at 16-128 rows it streams Qwen3-8B's e4m3 weights no faster than bf16 (docs/PERFORMANCE_LOG.md logs 21c, 22b).
With scalar scales (1.0) cuBLASLt picks from its whole FP8 catalogue: 2.45-2.77 against 3.75-4.22 ms of products a
step at 16-128 rows (log 23c). So up to ``MAX_ROWS`` rows (a decode batch) the product runs unscaled into the 16-bit
output and one kernel applies the token's and the channel's scale (and the bias) in place, in float32. Where the
kernel that reads the product next can apply them itself (``Unscaled``: an RMSNorm, the q/k norm + RoPE), the
rescale's launch and its pass over the product go (model/fp8_folded.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, use_pdl
from kernels.scaled_mm import unscaled_mm

# past this, rowwise scales: at prefill sizes the rescale's bytes cost more than the scalar product saves. 256 since
# the norm quantizes the rows (log 33b: W1 FP8 +2.1% over 128; unscaled at every size -0.6% against 256)
MAX_ROWS = 256
_BLOCK_N, _ROWS = 1024, 4  # a program's columns and rows


# M (the step's rows) is not specialized: a new row count does not recompile. N is: its divisibility by 16 (every N
# cuBLASLt's FP8 path takes) lets the column masks and addresses vectorize (sm_90a: 16-byte loads and stores
# instead of 2-byte ones).
@triton.jit(do_not_specialize=["M"])
def _rescale_kernel(
    out_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    M,
    N,
    stride_om,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (ROWS rows, BLOCK_N columns); the channel scales and the bias are weights: read before the
    # wait, once for all ROWS rows.
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    ws = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    for r in tl.static_range(ROWS):
        row = tl.program_id(1).to(tl.int64) * ROWS + r
        row_mask = mask & ((row + 0 * offs) < M)  # a tensor: the interpreter mis-types a scalar bool in a mask
        xs = tl.load(xs_ptr + tl.minimum(row, M - 1))
        ptrs = out_ptr + row * stride_om + offs
        y = tl.load(ptrs, mask=row_mask, other=0.0).to(tl.float32) * (xs * ws)
        if HAS_BIAS:
            y += bias
        tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@dataclass(slots=True)
class Unscaled:
    """A bias-free per-channel FP8 product before its scales: ``raw`` [M, N] 16-bit, to be multiplied by ``x_s``
    [M] (per token) and ``w_s`` [N] (per channel). A kernel that takes one applies them as ``rescale_`` does, in
    float32, rounded to ``raw``'s dtype, so its results are the rescale's bits."""

    raw: torch.Tensor
    x_s: torch.Tensor
    w_s: torch.Tensor

    def finished(self) -> torch.Tensor:
        """The scaled product, in place of ``raw``."""
        return rescale_(self.raw, self.x_s, self.w_s, None)


def rescale_(out: torch.Tensor, x_s: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """In place: ``out`` [M, N] times ``x_s`` [M] (or [M, 1]) along rows and ``w_s`` [N] along columns, plus
    ``bias`` [N]."""
    m, n = out.shape
    assert out.stride(1) == 1 and x_s.numel() == m and w_s.numel() == n
    if m == 0:
        return out
    pdl = use_pdl(out)
    _rescale_kernel[(triton.cdiv(n, _BLOCK_N), triton.cdiv(m, _ROWS))](
        out,
        x_s,
        w_s,
        out if bias is None else bias,
        m,
        n,
        out.stride(0),
        BLOCK_N=_BLOCK_N,
        ROWS=_ROWS,
        HAS_BIAS=bias is not None,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out


def applies(m: int) -> bool:
    """Whether an ``m``-row per-channel product takes this path (more rows: cuBLASLt's rowwise scales)."""
    return m <= MAX_ROWS


def scalar_scaled_linear(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """``(x_q * x_s) @ (w_q * w_s).T + bias`` into ``out``: e4m3 ``x_q`` [M, K] with per-row scales, ``w_q`` [N, K]
    with per-channel scales."""
    return rescale_(unscaled_mm(x_q, w_q, out), x_s, w_s, bias)
