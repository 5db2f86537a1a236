"""Does another cuBLASLt algorithm beat torch's pick on the decode products? Answered in docs/PERFORMANCE_LOG.md log 16.

For each layer shape of one rank and each row count, times torch's matmul (cuBLAS) and every candidate of
cuBLASLt's heuristic (kernels/cublaslt.py), each as (RMSNorm, GEMM) pairs over one weight per model layer inside a
CUDA graph (benchmarks/decode_gemm.py's ``graph_us``, as a decode step runs them). Prints us per GEMM, the best
candidate's rank in the heuristic's list and its config, and per-step totals. GPU only; the engine makes the same
choice at start (NANOSERVE_LT_TUNE), so re-run this for a new shape, dtype or cuBLAS version.

    python -m benchmarks.probes.lt_algos [--shape qwen3-8b-tp2] [--rows 16 32 64 128 256] [--count 32] [--split-k]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.decode_gemm import SHAPES, graph_us
from benchmarks.gpu import require_cuda
from kernels import cublaslt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shape", default="qwen3-8b-tp2", choices=list(SHAPES), help="model whose products to time")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 96, 128, 192, 256], help="decode batch sizes")
    p.add_argument("--count", type=int, default=32, help="heuristic candidates to time")
    p.add_argument("--split-k", action="store_true", help="also the top 4 candidates with other split-K counts")
    p.add_argument("--out", help="JSON of every cell (written after each)")
    a = p.parse_args()
    require_cuda()
    shapes, layers = SHAPES[a.shape]
    dt = torch.bfloat16
    totals = {m: [0.0, 0.0] for m in a.rows}
    cells = {}
    print(f"{'N x K':>13} {'M':>4} {'torch':>8} {'Lt #0':>8} {'best':>8} {'ratio':>6} {'rank':>4} {'n':>3}  config")
    for n, k in shapes:
        weights = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
        for m in a.rows:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = F.linear(x, weights[0]).float()
            torch_us = graph_us(F.linear, weights, x)
            algos = cublaslt.heuristic_algos(m, n, k, dt, a.count)
            heuristic = len(algos)
            if a.split_k:  # ranks past the heuristic's count are variants
                algos = cublaslt.with_split_k(cublaslt.problem(m, n, k, dt), algos, first=4)
            timed = []
            for rank, algo in enumerate(algos):
                try:
                    err = (cublaslt.lt_linear(x, weights[0], algo).float() - ref).abs().max().item()
                    if err > 5e-2:
                        print(f"  candidate {rank}: error {err:.3e}, skipped")
                        continue
                    us = graph_us(lambda x, w, algo=algo: cublaslt.lt_linear(x, w, algo), weights, x)
                except RuntimeError as e:
                    print(f"  candidate {rank}: {e}")
                    continue
                timed.append((us, rank))
            if not timed:
                print(f"{n:6d}x{k:<6d} {m:4d} {torch_us:8.2f}  no candidate ran")
                continue
            first = next((us for us, rank in timed if rank == 0), float("nan"))
            best_us, best_rank = min(timed)
            config = cublaslt.algo_config(algos[best_rank])
            totals[m][0] += torch_us * layers
            totals[m][1] += min(best_us, torch_us) * layers
            cells.setdefault(f"{n}x{k}", {})[str(m)] = {
                "torch_us": torch_us,
                "lt0_us": first,
                "best_us": best_us,
                "rank": best_rank,
                "config": config,
                "candidates": len(algos),
                "heuristic": heuristic,
                "all": sorted(timed),
            }
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(cells, f)
            print(
                f"{n:6d}x{k:<6d} {m:4d} {torch_us:8.2f} {first:8.2f} {best_us:8.2f} {best_us / torch_us:6.3f}"
                f" {best_rank:4d} {len(algos):3d}  {config}",
                flush=True,
            )
    print(f"\n{a.shape}: the 4 layer GEMMs x {layers} layers, ms per step (norm included)")
    for m, (t, b) in totals.items():
        print(f"  M {m:4d}: torch {t / 1e3:6.3f}  best Lt candidate {b / 1e3:6.3f}  ({b / max(t, 1e-9):.3f})")


if __name__ == "__main__":
    main()
