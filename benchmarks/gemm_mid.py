"""cuBLAS vs cuBLASLt on the Qwen3-8B TP=2 shard shapes at decode batches of 32-256 rows (GPU only), and how close
cuBLAS streams the weights to the HBM rate where the product is memory-bound (the TB/s column: weight bytes over
the GEMM's time, the norm's subtracted).

    python benchmarks/gemm_mid.py [--rows 32 64 128 256] [--shape qwen3-8b-tp2]

Each GEMM is timed inside a CUDA graph of (RMSNorm, GEMM) pairs over one weight per model layer (more than the L2
holds), as a decode step runs them. Prints us per GEMM for each library, and per-step totals. Our own split-K
kernel with row tiles lost to cuBLAS from 64 rows on (docs/PERF.md log 14a); branch mid-gemm keeps that kernel and
this script's sweep of its tilings.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decode_gemm import SHAPES, graph_us  # noqa: E402  (benchmarks/, the script's folder)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b-tp2", choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    a = p.parse_args()
    shapes, layers = SHAPES[a.shape]
    dt = torch.bfloat16
    totals = {m: [0.0, 0.0] for m in a.rows}
    print(f"{'N x K':>13} {'M':>4} {'cuBLAS':>8} {'Lt':>8} {'cuBLAS TB/s':>11}")
    for n, k in shapes:
        weights = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
        for m in a.rows:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            norm_us = graph_us(lambda x, w: x, weights, x)  # the norm alone: what each column adds to the GEMM
            ref = F.linear(x, weights[0]).float()
            torch.backends.cuda.preferred_blas_library("cublas")
            cublas = graph_us(F.linear, weights, x)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            lt_err = (F.linear(x, weights[0]).float() - ref).abs().max().item()
            lt = graph_us(F.linear, weights, x)
            torch.backends.cuda.preferred_blas_library("cublas")
            totals[m][0] += cublas * layers
            totals[m][1] += lt * layers
            weight_tbs = n * k * 2 / max(cublas - norm_us, 1e-3) / 1e6  # bytes / us -> TB/s
            print(
                f"{n:6d}x{k:<6d} {m:4d} {cublas:8.2f} {lt:8.2f} {weight_tbs:11.2f}"
                f"{'' if lt_err < 5e-2 else f'  (Lt err {lt_err:.2e})'}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    print(f"\n{a.shape}: the {len(shapes)} layer GEMMs x {layers} layers, ms per step (norm included)")
    for m, (c, lt) in totals.items():
        print(f"  M {m:4d}: cuBLAS {c / 1e3:6.3f}  cuBLASLt {lt / 1e3:6.3f}")


if __name__ == "__main__":
    main()
