"""Does PDL still pay for a chain of short kernels? Answered in docs/PERFORMANCE_LOG.md logs 7d and 17c. (GPU, sm90+)

A batch-1 decode step is a chain of ~400 short kernels; each pays a launch gap, a ramp and a tail. With PDL a
kernel may be scheduled while its predecessor finishes. This times a chain of 400 one-row elementwise kernels
inside a CUDA graph, launched plainly and with PDL (kernels/pdl.py's enter sequence). Measured on an H200:
1.08 -> 0.62 us per kernel. Re-run it on a new GPU, driver or Triton before relying on NANOSERVE_PDL's default;
benchmarks/decode_gemm.py compares the GEMMs.

    python -m benchmarks.probes.pdl_chain [--width 4096] [--kernels 400]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from kernels.graph_timing import graph_replay_us
from kernels.pdl import pdl_enter


@triton.jit
def _ew_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """y = x * 0.5 over one row: stands in for RMSNorm / SiLU-and-mul / q-k norm, one short memory-bound pass."""
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
    tl.store(y_ptr + offs, x * 0.5, mask=offs < N)


def chain_us(x: torch.Tensor, y: torch.Tensor, kernels: int, pdl: bool) -> float:
    """Microseconds per kernel of a graph of ``kernels`` launches (median of 10 replays)."""

    def run():
        for i in range(kernels):
            src, dst = (x, y) if i % 2 == 0 else (y, x)
            _ew_kernel[(triton.cdiv(x.numel(), 1024),)](
                src, dst, x.numel(), BLOCK=1024, USE_PDL=pdl, num_warps=4, launch_pdl=pdl
            )

    return graph_replay_us(run, kernels)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=4096, help="elements per kernel (one decode row of hidden size)")
    p.add_argument("--kernels", type=int, default=400)
    a = p.parse_args()
    x = torch.randn(a.width, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    plain, pdl = chain_us(x, y, a.kernels, False), chain_us(x, y, a.kernels, True)
    print(f"{a.kernels} kernels of {a.width} elements in a CUDA graph: {plain:.2f} us each, with PDL {pdl:.2f}")
    print(json.dumps({"width": a.width, "plain_us": plain, "pdl_us": pdl}))


if __name__ == "__main__":
    main()
