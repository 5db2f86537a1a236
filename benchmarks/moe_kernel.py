"""The fused MoE layer (kernels/fused_moe.py) on one layer of a real MoE shape, inside CUDA graphs (GPU only).

    python -m benchmarks.moe_kernel [--shape qwen3-30b-a3b] [--tp 1] [--tokens 1 8 64 256 1024 8192]
        [--tiles BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,WARPS,STAGES]

Per token count: microseconds per layer (routing, grouping, both grouped GEMMs, the top-k sum), the bytes it
must read (the experts uniform routing hits, E * (1 - (1 - k/E)^T), plus activations) as TB/s, and TFLOP/s;
the tiles moe_tiles picks, or --tiles for all (to try alternatives). One JSON line per row.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from benchmarks.shapes import SHAPES
from kernels.fused_moe import MoeTiles, fused_moe, moe_tiles
from kernels.graph_timing import graph_replay_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--shape",
        default="qwen3-30b-a3b",
        choices=[s for s in SHAPES if SHAPES[s].get("num_experts")],
        help="MoE model shape (default qwen3-30b-a3b)",
    )
    p.add_argument("--tp", type=int, default=1, help="benchmark one rank's slice of the intermediate dimension")
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192],
        help="token counts to time",
    )
    p.add_argument("--tiles", help="BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,WARPS,STAGES for every token count")
    a = p.parse_args()
    cfg = SHAPES[a.shape]
    experts, top_k, hidden = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    inter = cfg["moe_intermediate_size"] // a.tp
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * inter**-0.5
    expert_bytes = 3 * hidden * inter * w13.element_size()
    fixed = MoeTiles(*map(int, a.tiles.split(","))) if a.tiles else None
    for tokens in a.tokens:
        x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        logits = torch.randn(tokens, experts, device=dev, dtype=dtype)
        out = torch.empty_like(x)
        tiles = fixed or moe_tiles(tokens, top_k, experts, dtype)
        run = functools.partial(fused_moe, x, logits, w13, w2, top_k, True, out=out, tiles=tiles)
        us = graph_replay_us(run, 1, 20)
        hit = experts * (1 - (1 - top_k / experts) ** tokens)
        nbytes = hit * expert_bytes + tokens * top_k * (2 * hidden + 3 * inter) * x.element_size()
        flops = 2 * tokens * top_k * 3 * hidden * inter
        row = {
            "shape": a.shape,
            "tp": a.tp,
            "tokens": tokens,
            "us": round(us, 2),
            "tb_s": round(nbytes / us / 1e6, 3),
            "tflops": round(flops / us / 1e6, 1),
            "experts_hit": round(hit, 1),
            "tiles": [tiles.block_m, tiles.block_n, tiles.block_k, tiles.group_m, tiles.num_warps, tiles.num_stages],
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
