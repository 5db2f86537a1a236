"""How far ahead can a chain of PDL kernels start? Answered in docs/PERFORMANCE_LOG.md log 30b. (CUDA, sm90+)

Four one-program kernels in a CUDA graph, each launched with PDL. The first spins ``--spin-us`` after its wait;
the others do nothing. Each stamps the global timer when it starts, after its wait and when it ends. With every
kernel signalling before its wait (kernels/pdl.py), the third and fourth start while the first still spins; with
the second signalling after its wait, they start only once the first has ended. A kernel may therefore read before
its wait only what no kernel of the step writes, or what the kernel two in front wrote when the one between signals
late.

    python -m benchmarks.probes.pdl_depth [--spin-us 50]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from kernels.pdl import pdl_enter


@triton.jit
def _stamp_kernel(stamps_ptr, index, spin_ns, SIGNAL_FIRST: tl.constexpr, USE_PDL: tl.constexpr):
    started = globaltimer()
    pdl_enter(USE_PDL, SIGNAL_FIRST)
    waited = globaltimer()
    while globaltimer() - waited < spin_ns:
        pass
    tl.store(stamps_ptr + index * 3, started)
    tl.store(stamps_ptr + index * 3 + 1, waited)
    tl.store(stamps_ptr + index * 3 + 2, globaltimer())


def chain(stamps: torch.Tensor, spin_ns: int, second_signals_first: bool) -> None:
    for index in range(4):
        signal_first = second_signals_first or index != 1
        spin = spin_ns if index == 0 else 0
        _stamp_kernel[(1,)](stamps, index, spin, signal_first, True, launch_pdl=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--spin-us", type=int, default=50, help="how long the first kernel works after its wait")
    args = p.parse_args()
    stamps = torch.zeros(12, dtype=torch.int64, device="cuda")
    print("us from the first kernel's start: [start, after the wait, end] of kernels 1-4")
    for second_signals_first in (True, False):
        chain(stamps, args.spin_us * 1000, second_signals_first)  # compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(stamps, args.spin_us * 1000, second_signals_first)
        graph.replay()
        torch.cuda.synchronize()
        us = ((stamps.view(4, 3) - stamps[0]).double() / 1000).tolist()
        rows = "  ".join(f"[{a:.1f}, {b:.1f}, {c:.1f}]" for a, b, c in us)
        print(f"second kernel signals {'first' if second_signals_first else 'after its wait'}: {rows}")


if __name__ == "__main__":
    main()
