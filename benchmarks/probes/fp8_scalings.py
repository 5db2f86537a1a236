"""Is an FP8 product with scalar scales, rescaled afterwards, faster than the per-token x per-channel one?

torch._scaled_mm with rowwise scales (what the engine runs past the GEMV's rows) streams Qwen3-8B's e4m3 weights
at 16-128 rows no faster than bf16 (docs/PERFORMANCE_LOG.md log 21c), and cuBLASLt offers one algorithm for it
(log 22b). With scalar scales cuBLASLt has its whole FP8 catalogue; the per-token and per-channel scales would then
be applied to the output: kernels/fp8_rescale.py, the engine's path up to its MAX_ROWS.

For each row count, the per-step total over every layer's four products (each behind an RMSNorm, CUDA graph):
rowwise, scalar, scalar + the rescale kernel, and bf16 cuBLAS. GPU only.

    python -m benchmarks.probes.fp8_scalings [--shape qwen3-8b] [--rows 16 32 64 128 256]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.decode_gemm import SHAPES, graph_us
from benchmarks.gpu import require_cuda
from kernels import fp8_rescale, scaled_mm
from kernels.fp8_quant import quantize_rows
from model.fp8 import quantize_per_channel


def time_rows(k: int, m: int, bf16: list, fp8: list) -> tuple[list[float], float]:
    """us per product at ``m`` rows: rowwise, scalar, scalar + rescale, bf16; and the rescaled one's relative error
    against the rowwise one."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = quantize_rows(x, None)
    out = torch.empty(m, bf16[0].shape[0], device="cuda", dtype=torch.bfloat16)
    ref = scaled_mm.scaled_mm(x_q, x_s, *fp8[0], None, None, out).float().clone()

    def scalar(_, w):
        return scaled_mm.unscaled_mm(x_q, w[0], out)

    def rescaled(_, w):
        return fp8_rescale.scalar_scaled_linear(x_q, x_s, *w, None, out)

    err = ((rescaled(None, fp8[0]).float() - ref).norm() / ref.norm()).item()
    us = [
        graph_us(lambda _, w: scaled_mm.scaled_mm(x_q, x_s, *w, None, None, out), fp8, x),
        graph_us(scalar, fp8, x),
        graph_us(rescaled, fp8, x),
        graph_us(lambda h, w: h @ w.t(), bf16, x),
    ]
    return us, err


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES), help="model whose linear layers to time")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256], help="rows per product")
    a = p.parse_args()
    require_cuda()
    shapes, layers = SHAPES[a.shape]
    totals: dict[int, list[float]] = {m: [0.0] * 4 for m in a.rows}
    for n, k in shapes:
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(layers)]
        fp8 = [quantize_per_channel(w) for w in bf16]
        for m in a.rows:
            us, err = time_rows(k, m, bf16, fp8)
            print(f"{n:6d}x{k:<6d} {m:4d} " + " ".join(f"{u:8.2f}" for u in us) + f"  rel err {err:.1e}", flush=True)
            for i, u in enumerate(us):
                totals[m][i] += u * layers / 1000
        del bf16, fp8
        torch.cuda.empty_cache()
    print(f"{'rows':>5s} {'rowwise':>9s} {'scalar':>9s} {'+rescale':>9s} {'bf16':>9s}   ms a step, {layers} layers")
    for m, t in totals.items():
        print(f"{m:5d} " + " ".join(f"{v:9.3f}" for v in t))


if __name__ == "__main__":
    main()
