"""Does another cuBLASLt algorithm beat torch._scaled_mm's pick on the FP8 decode products (per-token x per-channel
scales)? At 2-128 rows torch's pick streams Qwen3-8B's e4m3 weights no faster than bf16 (docs/PERFORMANCE_LOG.md
log 21c); if a candidate of kernels/cublaslt_fp8.py does much better, the engine should choose at start as it does
for bf16 (kernels/cublaslt_tune.py ``tune``).

For each product of the shape and each row count, times torch._scaled_mm (kernels/scaled_mm.py ``scaled_mm``)
and every candidate, each behind an RMSNorm over one weight per model layer inside a CUDA graph (the activations
quantized once, outside: the products alone are compared). Prints us per product, the best candidate's rank and
config, then per-step totals by row count. GPU only.

    python -m benchmarks.probes.lt_fp8_algos [--shape qwen3-8b] [--rows 2 4 8 16 32 64 128 256] [--count 32]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.decode_gemm import SHAPES, graph_us
from benchmarks.gpu import require_cuda
from kernels import cublaslt, cublaslt_fp8, scaled_mm
from kernels.fp8_quant import quantize_rows
from model.fp8 import quantize_per_channel


def time_cell(n: int, k: int, m: int, weights: list, count: int) -> tuple[float, float, int, list] | None:
    """us per product of torch._scaled_mm and of the best candidate, its rank and the candidates, at ``m`` rows."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = quantize_rows(x, None)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = scaled_mm.scaled_mm(x_q, x_s, *weights[0], None, None, out).float().clone()
    torch_us = graph_us(lambda _, w: scaled_mm.scaled_mm(x_q, x_s, *w, None, None, out), weights, x)
    try:
        algos = cublaslt_fp8.algos(m, n, k, count)
    except RuntimeError as e:  # a refused descriptor or heuristic query: report, keep going
        print(f"{n:6d}x{k:<6d} {m:4d} {torch_us:8.2f}  no candidates: {e}")
        return None
    timed = []
    for rank, algo in enumerate(algos):

        def run(_, w, algo=algo):
            return cublaslt_fp8.scaled_linear(x_q, x_s, *w, algo, out)

        try:
            err = ((run(None, weights[0]).float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                print(f"  candidate {rank}: relative error {err:.2e}, skipped")
                continue
            timed.append((graph_us(run, weights, x), rank))
        except RuntimeError as e:
            print(f"  candidate {rank}: {e}")
    if not timed:
        print(f"{n:6d}x{k:<6d} {m:4d} {torch_us:8.2f}  no candidate ran ({len(algos)} listed)")
        return None
    best_us, rank = min(timed)
    return torch_us, best_us, rank, algos


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES), help="model whose products to time")
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256], help="decode batch sizes")
    p.add_argument("--count", type=int, default=32, help="heuristic candidates to time")
    a = p.parse_args()
    require_cuda()
    shapes, layers = SHAPES[a.shape]
    totals = {m: [0.0, 0.0] for m in a.rows}
    print(f"{'N x K':>13} {'M':>4} {'torch':>8} {'best':>8} {'ratio':>6} {'rank':>4} {'n':>3}  config")
    for n, k in shapes:
        weights = [quantize_per_channel(torch.randn(n, k, device="cuda") * 0.02) for _ in range(layers)]
        for m in a.rows:
            cell = time_cell(n, k, m, weights, a.count)
            if cell is None:
                continue
            torch_us, best_us, rank, algos = cell
            totals[m][0] += torch_us * layers
            totals[m][1] += min(best_us, torch_us) * layers
            print(
                f"{n:6d}x{k:<6d} {m:4d} {torch_us:8.2f} {best_us:8.2f} {best_us / torch_us:6.3f} {rank:4d} "
                f"{len(algos):3d}  {json.dumps(cublaslt.algo_config(algos[rank]))}"
            )
    for m, (t, b) in totals.items():
        print(json.dumps({"rows": m, "torch_ms_per_step": round(t / 1e3, 3), "best_ms_per_step": round(b / 1e3, 3)}))


if __name__ == "__main__":
    main()
