"""Weights of the next products pulled into the L2 cache while a one-row decode step's attention runs.

At one row, a layer's attention (q/k norm + RoPE, split decode, merge) is a chain of short kernels that read a few
KB each, so the memory bus idles for several microseconds between the q/k/v GEMV and the o GEMV, whose programs
cannot all be resident early. This kernel, placed after q/k/v, asks the L2 to fetch o_proj's weight and the head of
gate/up's (``cp.async.bulk.prefetch.L2``: no registers, no completion to wait on), so those GEMVs read them from
the L2. A hint only: it changes no value. Hopper and newer (sm_90); elsewhere it is not launched.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, use_pdl
from protocol.settings import settings

CHUNK = 4096  # bytes a prefetch instruction asks for
_BLOCK = 256  # prefetches a program
_BUDGET = settings().l2_prefetch_mb << 20  # NANOSERVE_L2_PREFETCH_MB: bytes a layer (0: off)


@triton.jit
def _prefetch(addr):
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], 4096;\n\tmov.u32 $0, 0;",
        "=r,l",
        [addr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _l2_prefetch_kernel(a_ptr, a_chunks, b_ptr, b_chunks, USE_PDL: tl.constexpr, BLOCK: tl.constexpr):
    # after the wait: the q/k/v GEMV in front has the bus until it completes
    pdl_enter(USE_PDL)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_a = c < a_chunks
    # chunks past the end repeat the last one: every address stays inside its tensor
    off_a = tl.minimum(c, a_chunks - 1).to(tl.int64) * 4096
    off_b = tl.minimum(tl.maximum(c - a_chunks, 0), b_chunks - 1).to(tl.int64) * 4096
    _prefetch(tl.where(in_a, a_ptr + off_a, b_ptr + off_b))


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefetch_l2(first: torch.Tensor, then: torch.Tensor | None) -> None:
    """Ask the L2 for all of ``first`` and the head of ``then`` up to the byte budget (contiguous weights)."""
    if _BUDGET <= 0 or not first.is_cuda or not use_pdl(first) or not _device_ok(first.device.index or 0):
        return
    a_chunks = min(first.numel() * first.element_size(), _BUDGET) // CHUNK
    left = _BUDGET - a_chunks * CHUNK
    b_chunks = 0 if then is None else min(then.numel() * then.element_size(), left) // CHUNK
    total = a_chunks + b_chunks
    if a_chunks == 0:
        return
    a, b = first.view(torch.uint8), (then if b_chunks else first).view(torch.uint8)  # byte addresses
    _l2_prefetch_kernel[(triton.cdiv(total, _BLOCK),)](
        a, a_chunks, b, max(b_chunks, 1), USE_PDL=True, BLOCK=_BLOCK, launch_pdl=True
    )
