"""How should the FP8 MLP's middle kernel (kernels/fp8_mlp.py: scales, SiLU-and-mul, per-token quantization) be
tiled at prefill's row counts? A W1 FP8 prefill step (8,192 rows, Qwen3-8B) spends 12.9 ms in it, 358 us a layer
for ~503 MB: 1.4 TB/s (log 34). One 16-warp program holds a whole row; two-pass programs of fewer columns may hide
latency better. Times every (block, warps) at each row count, checks the bits against the engine's choice.

    python -m benchmarks.probes.silu_mul_quant_tiles [--rows 256 8192] [--n 12288]
"""

from __future__ import annotations

import argparse

import torch
import triton

from benchmarks.gpu import require_cuda
from kernels import fp8_mlp


def run(y, xs, ws, block: int, warps: int):
    m, n = y.shape[0], y.shape[1] // 2
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=y.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=y.device)
    fp8_mlp._silu_mul_quant_kernel[(m,)](
        y, xs, ws, y, q, s, n, y.stride(0), q.stride(0),
        HAS_BIAS=False, SCALED=True, BLOCK=block, ONE_STEP=block >= n, USE_PDL=False, num_warps=warps,
    )  # fmt: skip
    return q, s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 8192], help="row counts to time")
    p.add_argument("--n", type=int, default=12288, help="the down input's columns (gate/up is twice)")
    a = p.parse_args()
    require_cuda(1)
    print(f"{'rows':>6s} {'block':>6s} {'warps':>5s} {'us':>8s} {'TB/s':>6s} same bits")
    for m in a.rows:
        y = torch.randn(m, 2 * a.n, device="cuda", dtype=torch.bfloat16).mul_(200)
        xs = torch.rand(m, device="cuda") * 0.01 + 0.001
        ws = torch.rand(2 * a.n, device="cuda") * 0.01 + 0.001
        ref_q, ref_s = fp8_mlp.silu_mul_quant(y, xs, ws)
        moved = y.numel() * 2 + m * a.n  # bf16 in, e4m3 out
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                if block // (32 * warps) < 1:
                    continue
                q, s = run(y, xs, ws, block, warps)
                same = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
                us = (
                    triton.testing.do_bench(lambda b=block, w=warps, t=(y, xs, ws): run(*t, b, w), warmup=20, rep=100)
                    * 1e3
                )
                print(f"{m:6d} {block:6d} {warps:5d} {us:8.1f} {moved / us / 1e6:6.2f} {same}", flush=True)


if __name__ == "__main__":
    main()
