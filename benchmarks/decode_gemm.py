"""cuBLAS (F.linear) vs kernels/decode_gemm.py on Qwen3 linear shapes at decode batch sizes (GPU only).

    python -m benchmarks.decode_gemm [--shape qwen3-0.6b|qwen3-8b|qwen3-8b-tp2|qwen3-30b-a3b|lm-head-8b|
        lm-head-30b-a3b] [--rows 1 16] [--whole-slices]

Each GEMM is timed inside a CUDA graph of (RMSNorm, GEMM) pairs over one layer's weight per model layer (more
than the L2 holds), as a decode step runs them; our kernel with PDL on, as the model launches it. Prints the best
tiling per (shape, rows), what decode_linear_tiles picks ("auto", "-" = cuBLAS), and per-step totals.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.gpu import require_cuda
from kernels import fused
from kernels.decode_gemm import GEMV_MAX_ROWS, MAX_ROWS, Tiles, decode_linear, decode_linear_tiles
from kernels.graph_timing import graph_replay_us

SHAPES = {  # per layer (N, K): qkv, o, gate_up, down; and the layer count
    "qwen3-0.6b": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], 28),
    "qwen3-8b": ([(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)], 36),
    "qwen3-8b-tp2": ([(3072, 4096), (4096, 2048), (12288, 4096), (4096, 6144)], 36),  # one rank's shards
    "qwen3-30b-a3b": ([(5120, 2048), (2048, 4096)], 48),  # qkv and o only: its experts take kernels/moe_decode.py
    # the LM heads (Qwen3's vocabulary), which run on cuBLAS outside the graphs: would the GEMV take them?
    "lm-head-8b": ([(151936, 4096)], 1),
    "lm-head-30b-a3b": ([(151936, 2048)], 1),
}


def graph_us(fn, weights, x) -> float:
    """Microseconds per call of fn(rmsnorm(x), w) over every layer's weight, twice per replay: each GEMM behind
    a short kernel, as in a decode step (the norm's time is in every column)."""
    norm_w = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)

    def run():
        for _ in range(2):
            for w in weights:
                fn(fused.rmsnorm(x, norm_w, 1e-6), w)

    return graph_replay_us(run, 2 * len(weights), replays=5)


def tilings(n: int, k: int, m: int, whole_slices: bool):
    """Candidate tiles. Default: the split-K ``tl.dot`` tilings (docs/PERFORMANCE_LOG.md log 7). ``whole_slices``:
    the GEMV kernel (up to GEMV_MAX_ROWS rows) with 8, 16 or 32 KB of weight per program, loaded before the PDL
    wait. (Whole slices through ``tl.dot`` lost 1.5-2.7x to cuBLAS, log 8.)"""
    if not whole_slices:
        for bn in (32, 64, 128):
            for bk in (64, 128):
                for split in (1, 2, 4):
                    if n % bn == 0 and k % (split * bk) == 0:
                        yield Tiles(bn, bk, split, 4, 3)
        return
    if m > GEMV_MAX_ROWS:
        return
    for elems in (4096, 8192, 16384):
        for bk in (1024, 2048, 4096):
            bn = elems // bk
            if bn >= 1 and bk <= k and k % bk == 0 and n % bn == 0 and k // bk <= 32:
                yield Tiles(bn, bk, k // bk, 4, 1, True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES), help="model whose linear layers to time")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="decode batch sizes (rows per GEMM)")
    p.add_argument("--whole-slices", action="store_true", help="sweep the GEMV kernel's whole-slice tiles")
    a = p.parse_args()
    require_cuda()
    shapes, layers = SHAPES[a.shape]
    dt = torch.bfloat16
    assert max(a.rows) <= MAX_ROWS
    totals: dict[int, list[float]] = {m: [0.0, 0.0, 0.0] for m in a.rows}
    best_tiles = {}
    print(f"{'N x K':>13} {'M':>4} {'cuBLAS us':>9} {'best us':>8} {'ratio':>6} {'auto us':>8}  best tiles / auto")
    for n, k in shapes:
        weights = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(layers)]
        for m in a.rows:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = F.linear(x, weights[0])
            cublas = graph_us(F.linear, weights, x)
            best = (float("inf"), None)
            for tiles in tilings(n, k, m, a.whole_slices):
                try:
                    err = (decode_linear(x, weights[0], tiles).float() - ref.float()).abs().max().item()
                    assert err < 5e-2, (tiles, err)
                    us = graph_us(lambda x, w, t=tiles: decode_linear(x, w, t), weights, x)
                except Exception as e:  # noqa: BLE001 (a tiling that does not fit in shared memory)
                    print(f"  {tiles}: {type(e).__name__} {str(e)[:80]}")
                    continue
                print(f"    {tuple(tiles)} {us:.2f} us")
                best = min(best, (us, tiles))
            auto_tiles = decode_linear_tiles(x, weights[0])
            auto = cublas
            if auto_tiles is not None:
                auto = graph_us(lambda x, w, t=auto_tiles: decode_linear(x, w, t), weights, x)
            totals[m][0] += cublas * layers
            totals[m][1] += best[0] * layers
            totals[m][2] += auto * layers
            best_tiles[f"{n}x{k}@{m}"] = best[1] and tuple(best[1])
            print(
                f"{n:6d}x{k:<6d} {m:4d} {cublas:9.2f} {best[0]:8.2f} {best[0] / cublas:6.2f} {auto:8.2f}  "
                f"{tuple(best[1]) if best[1] else None} / {tuple(auto_tiles) if auto_tiles else '-'}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    print(f"\n{a.shape}: the {len(shapes)} layer GEMMs x {layers} layers, ms per step")
    for m, (c, o, auto) in totals.items():
        print(
            f"  M {m:4d}: cuBLAS {c / 1e3:6.3f}  best {o / 1e3:6.3f}  auto {auto / 1e3:6.3f}  "
            f"saves {(c - auto) / 1e3:6.3f}"
        )
    print(json.dumps(best_tiles))


if __name__ == "__main__":
    main()
