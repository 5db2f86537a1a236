"""cuBLAS (F.linear) vs kernels/skinny_gemm.py on the Qwen3 linear shapes at decode batch sizes (GPU only).

    python benchmarks/skinny_gemm.py [--rows 1 16]

Each call is timed inside a CUDA graph of back-to-back calls cycling over 8 copies of the weight (more than the
L2 holds), as the decode graphs run them: GB/s is weight bytes over time. Prints the best tiling per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.skinny_gemm import default_tiles, skinny_gemm

SHAPES = {  # name: (N, K)
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (24576, 4096),
    "8b down": (4096, 12288),
    "0.6b qkv": (4096, 1024),
    "0.6b o": (1024, 2048),
    "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072),
}
TILINGS = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256) for w, st in ((4, 3), (4, 5), (8, 4))]
COPIES = 8


def graph_us(fn, weights, x) -> float:
    """Microseconds per call of fn(x, w), replayed in a graph cycling over the weights."""
    for w in weights:
        fn(x, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            for w in weights:
                fn(x, w)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (4 * len(weights)))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dtype = torch.bfloat16
    rows = []
    print(
        f"{'shape':>13} {'M':>3} {'cuBLAS us':>9} {'GB/s':>5} {'default us':>10} {'best us':>8} {'GB/s':>5}  best tiles"
    )
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(COPIES)]
        gbytes = n * k * 2 / 1e3
        for m in a.rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = F.linear(x, weights[0])
            assert (skinny_gemm(x, weights[0]).float() - ref.float()).abs().max().item() < 2e-2
            cublas = graph_us(F.linear, weights, x)
            default = graph_us(skinny_gemm, weights, x)
            best = (default, default_tiles(n, k, x.device))
            for tiles in TILINGS:
                try:
                    us = graph_us(lambda x, w, t=tiles: skinny_gemm(x, w, t), weights, x)
                except Exception as e:  # too much shared memory for a deep pipeline of wide tiles
                    print(f"  {tiles}: {type(e).__name__}")
                    continue
                if us < best[0]:
                    best = (us, tiles)
            rows.append(
                {
                    "shape": name,
                    "m": m,
                    "cublas_us": cublas,
                    "default_us": default,
                    "best_us": best[0],
                    "best_tiles": best[1],
                }
            )
            print(
                f"{name:>13} {m:3d} {cublas:9.2f} {gbytes / cublas:5.0f} {default:10.2f} {best[0]:8.2f} "
                f"{gbytes / best[0]:5.0f}  {best[1]}"
            )
        del weights
        torch.cuda.empty_cache()
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
