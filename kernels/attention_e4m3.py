"""The split decode's tile over an e4m3 (FP8) cache as e4m3 tensor-core dots, for 16-bit queries.

Widening every e4m3 key and value to float16 and padding a query group of 4 heads to the 16 rows of an mma was
the decode kernel's per-key work, and it, not HBM, set its speed over e4m3 (docs/PERFORMANCE_LOG.md log 21f).
Here the dots are transposed so the keys are the M dimension (64-row wgmma tiles on Hopper) and K and V enter
them as stored: scores^T = K q^T and O^T = V^T P^T. The query and the probabilities are split into a high and a
low e4m3 part each (x = hi + lo / 16, hi and lo both e4m3), two dots per product, which keeps the result within
~0.2% of float16 dots where one e4m3 part each would be ~6% off. Scales: q per head row (its max to 448, folded
into the scores); P times 256 (so probabilities down to ~1e-5 keep their bits), divided out at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import is_fp8
from protocol.settings import settings


def e4m3_dots(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the split decode takes these dots: an e4m3 cache, a 16-bit query (NANOSERVE_E4M3_DOTS=0: no)."""
    return is_fp8(k_cache) and q.dtype in (torch.bfloat16, torch.float16) and settings().e4m3_dots


P_SCALE = tl.constexpr(256.0)  # P in [0, 1] -> [0, 256]: under e4m3's 448, its subnormals reach ~1e-5 of P


@triton.jit
def two_part_e4m3(x):
    """``x`` (float32, |x| <= 448) as e4m3 ``hi`` and ``lo`` with x ~ hi + lo / 16 (the rest of a round to nearest
    is at most half an e4m3 ulp, <= 16 below 448, so 16 times it stays in range)."""
    hi = x.to(tl.float8e4nv)
    lo = ((x - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
    return hi, lo


@triton.jit
def e4m3_query(q, qk_scale):
    """The query group [BLOCK_H, BLOCK_D] (16-bit; padded rows zero) as two e4m3 parts, each row scaled to 448,
    and the per-row factor that turns their dots back into scores (log2 units)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), axis=1)
    row_scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
    hi, lo = two_part_e4m3(qf / row_scale[:, None])
    return hi, lo, row_scale * qk_scale


@triton.jit
def e4m3_tile(k, v, q_hi, q_lo, score_scale, mask_n, m_i, l_i, acc_t):
    """One K/V tile of the online softmax: ``k``, ``v`` [BLOCK_N, BLOCK_D] e4m3 as stored (masked keys zero),
    the running max and sum [BLOCK_H], and the transposed accumulator ``acc_t`` [BLOCK_D, BLOCK_H] (times
    P_SCALE)."""
    s = tl.dot(k, tl.trans(q_hi)) + tl.dot(k, tl.trans(q_lo)) * (1.0 / 16.0)  # [BLOCK_N, BLOCK_H]
    s = tl.where(mask_n[:, None], s * score_scale[None, :], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    p = tl.exp2(s - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    p_hi, p_lo = two_part_e4m3(p * P_SCALE)
    vt = tl.trans(v)
    acc_t = acc_t * alpha[None, :] + tl.dot(vt, p_hi) + tl.dot(vt, p_lo) * (1.0 / 16.0)
    return m_new, l_i, acc_t


@triton.jit
def e4m3_result(acc_t):
    """``e4m3_tile``'s accumulator as the usual [BLOCK_H, BLOCK_D] sum of P times V."""
    return tl.trans(acc_t) * (1.0 / P_SCALE)
