"""How should the FP8 MLP's middle kernel (kernels/fp8_mlp.py: scales, SiLU-and-mul, per-token quantization) be
tiled? Times the engine's tiling and candidates at each row count (1: W2's finished one-row product, unscaled;
more: the scaled middle of the fused FP8 MLP), and checks every candidate's bits against the engine's.
Candidates: "whole" holds the row as a power of two plus a power-of-two rest (Qwen3-8B: 8,192 + 4,096 columns),
one pass; "steps" takes two passes over slices, the second from cache; r2/r4 take 2 or 4 rows a program.

    python -m benchmarks.probes.silu_mul_quant_tiles [--rows 1 256 8192] [--n 12288]
"""

from __future__ import annotations

import argparse

import torch
import triton

from benchmarks.gpu import require_cuda
from kernels import fp8_mlp
from kernels.fp8_mlp import Tiling, whole_row


def candidates(n: int, m: int) -> dict[str, Tiling]:
    out = {"engine": fp8_mlp.default_tiling(m, n, True)}
    for warps in (8, 16, 32):
        for rows in (1, 2):
            if rows == 1 or m >= 64:
                out[f"whole r{rows} w{warps}"] = whole_row(n, rows, warps)
    if m >= 64:
        out["whole r4 w32"] = whole_row(n, 4, 32)
        for block, warps in ((2048, 8), (4096, 8), (4096, 16)):
            out[f"steps {block} w{warps}"] = Tiling(block, 0, 1, warps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 256, 8192], help="row counts to time")
    p.add_argument("--n", type=int, default=12288, help="the down input's columns (gate/up is twice)")
    a = p.parse_args()
    require_cuda(1)
    print(f"{'rows':>6s} {'tiling':>16s} {'us':>8s} {'TB/s':>6s} same bits")
    for m in a.rows:
        y = torch.randn(m, 2 * a.n, device="cuda", dtype=torch.bfloat16).mul_(200)
        scaled = m > 1
        xs = torch.rand(m, device="cuda") * 0.01 + 0.001 if scaled else None
        ws = torch.rand(2 * a.n, device="cuda") * 0.01 + 0.001 if scaled else None
        ref_q, ref_s = fp8_mlp.silu_mul_quant(y, xs, ws)
        moved = y.numel() * 2 + m * a.n  # bf16 in, e4m3 out
        for name, tiling in candidates(a.n, m).items():
            q = torch.empty_like(ref_q)
            s = torch.empty_like(ref_s)
            try:
                fp8_mlp.launch(y, xs, ws, None, q, s, tiling)
            except Exception as e:  # a tiling the compiler refuses (resources): reported, not fatal
                print(f"{m:6d} {name:>16s} failed: {type(e).__name__}", flush=True)
                continue
            same = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
            args = (y, xs, ws, None, q, s, tiling)
            ms = triton.testing.do_bench(lambda c=args: fp8_mlp.launch(*c), warmup=20, rep=100)
            print(f"{m:6d} {name:>16s} {ms * 1e3:8.1f} {moved / ms / 1e9:6.2f} {same}", flush=True)


if __name__ == "__main__":
    main()
