"""cuBLAS vs cuBLASLt vs a Triton tl.dot GEMM on the Qwen3-8B TP=2 shard shapes at decode batches of 32-256 rows
(GPU only): which tiling fills 132 SMs best where cuBLAS's tiles leave a partial wave, and how close cuBLAS streams
the weights to the HBM rate where the product is memory-bound (the TB/s column: weight bytes over the GEMM's time,
the norm's subtracted).

    python benchmarks/gemm_mid.py [--rows 32 64 128 256] [--shape qwen3-8b-tp2]

Each GEMM is timed inside a CUDA graph of (RMSNorm, GEMM) pairs over one weight per model layer (more than the L2
holds), as a decode step runs them. Prints us per GEMM for each backend and the best Triton tiling, and per-step
totals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decode_gemm import SHAPES, graph_us  # noqa: E402  (benchmarks/, the script's folder)

from kernels.decode_gemm import _sum_splits_kernel  # noqa: E402
from kernels.pdl import pdl_enter, use_pdl  # noqa: E402


# kernels/decode_gemm.py's _split_gemm_kernel with a grid axis of row tiles (it has one row tile). Branch mid-gemm
# gives the production kernel row tiles and this script calls it instead; until that is measured on a GPU, main
# keeps this measurement copy (docs/PERF.md log 13g, m2).
@triton.jit(do_not_specialize=["M"])
def _mid_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # m fastest: the programs sharing a weight tile run together, so the tile comes from HBM once
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    k_per_split = K // SPLIT_K
    k0 = pid_k * k_per_split
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs + k)
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def mid_gemm(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, ...]) -> torch.Tensor:
    bm, bn, bk, split, warps, stages = tiles
    m, k = x.shape
    n = w.shape[0]
    assert k % (split * bk) == 0 and n % bn == 0, (x.shape, w.shape, tiles)  # whole tiles in every split
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    pdl = use_pdl(x)
    grid = (triton.cdiv(m, bm) * (n // bn), split)
    _mid_gemm_kernel[grid](
        x, w, part, m, n, k, x.stride(0), w.stride(0), n, m * n if split > 1 else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, USE_PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl,
    )  # fmt: skip
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](
            part, out, m * n, SPLIT_K=split, BLOCK=1024, USE_PDL=pdl, num_warps=4, launch_pdl=pdl
        )
    return out


def candidates(n: int, k: int, m: int):
    for bm, bn, bk, warps, stages in (
        (16, 64, 128, 4, 4),
        (16, 64, 256, 4, 4),  # weight streaming: deep K tiles, several stages in flight
        (32, 64, 128, 4, 4),
        (32, 64, 256, 4, 3),
        (32, 128, 128, 4, 3),
        (64, 64, 128, 4, 4),
        (64, 128, 128, 4, 3),
        (64, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 256, 64, 8, 3),
        (128, 64, 64, 4, 4),
        (128, 64, 128, 4, 3),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 256, 64, 8, 3),
        (256, 64, 64, 8, 3),
        (256, 128, 64, 8, 3),
    ):
        if bm > max(16, triton.next_power_of_2(m)) or n % bn:
            continue
        tiles = triton.cdiv(m, bm) * (n // bn)
        for split in (1, 2, 3, 4, 8):
            if k % (split * bk) == 0 and (split == 1 or tiles * split <= 4 * 132):
                yield (bm, bn, bk, split, warps, stages)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b-tp2", choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    a = p.parse_args()
    shapes, layers = SHAPES[a.shape]
    dt = torch.bfloat16
    totals = {m: [0.0, 0.0, 0.0] for m in a.rows}
    best_tiles = {}
    print(
        f"{'N x K':>13} {'M':>4} {'cuBLAS':>8} {'Lt':>8} {'triton':>8} {'ratio':>6} {'cuBLAS TB/s':>11}"
        "  best (bm bn bk split w st)"
    )
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
            best = (float("inf"), None)
            for tiles in candidates(n, k, m):
                try:
                    err = (mid_gemm(x, weights[0], tiles).float() - ref).abs().max().item()
                    assert err < 5e-2, (tiles, err)
                    us = graph_us(lambda x, w, t=tiles: mid_gemm(x, w, t), weights, x)
                except Exception as e:  # noqa: BLE001 (a tiling that does not fit in shared memory)
                    print(f"  {tiles}: {type(e).__name__} {str(e)[:80]}")
                    continue
                best = min(best, (us, tiles))
            totals[m][0] += cublas * layers
            totals[m][1] += lt * layers
            totals[m][2] += best[0] * layers
            best_tiles[f"{n}x{k}@{m}"] = best[1]
            weight_tbs = n * k * 2 / max(cublas - norm_us, 1e-3) / 1e6  # bytes / us -> TB/s
            print(
                f"{n:6d}x{k:<6d} {m:4d} {cublas:8.2f} {lt:8.2f} {best[0]:8.2f} {best[0] / cublas:6.2f}"
                f" {weight_tbs:11.2f}  {best[1]}"
                f"{'' if lt_err < 5e-2 else f'  (Lt err {lt_err:.2e})'}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    print(f"\n{a.shape}: the {len(shapes)} layer GEMMs x {layers} layers, ms per step (norm included)")
    for m, (c, lt, tr) in totals.items():
        print(f"  M {m:4d}: cuBLAS {c / 1e3:6.3f}  cuBLASLt {lt / 1e3:6.3f}  best triton per shape {tr / 1e3:6.3f}")
    print(json.dumps(best_tiles))


if __name__ == "__main__":
    main()
