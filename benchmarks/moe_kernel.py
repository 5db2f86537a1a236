"""The MoE layer on one layer of a real MoE shape, inside CUDA graphs (GPU only): the fused path
(kernels/fused_moe.py) and/or the decode path for a few tokens (kernels/moe_decode.py).

    python -m benchmarks.moe_kernel [--shape qwen3-30b-a3b] [--tp 1] [--path fused|decode|both] [--layers 1]
        [--tokens 1 8 64 256 1024 8192] [--tiles BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,WARPS,STAGES]
        [--decode-tiles BLOCK_I,BLOCK_H,BLOCK_N,BLOCK_K,WARPS_GATE_UP,WARPS_DOWN]

Per token count and path: microseconds per layer (routing through the top-k sum), the bytes it must read (the
experts uniform routing hits, E * (1 - (1 - k/E)^T), plus activations) as TB/s, and TFLOP/s; the tiles moe_tiles or
decode_tiles picks, or --tiles / --decode-tiles for all (to try alternatives). --layers N replays N layers of
distinct weights, as a model step streams them, so that the L2 cannot hold the experts of the layer before. The
decode rows also give their relative error against the fused path; with --path both a last row per token count
gives decode/fused. One JSON line per row. Token counts default to 1, 2, 4 when the decode path is timed.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from benchmarks.shapes import SHAPES
from kernels.fused_moe import MoeTiles, fused_moe, moe_tiles
from kernels.graph_timing import graph_replay_us
from kernels.moe_decode import DecodeTiles, decode_tiles

FUSED_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192]


def _layers(call, w13s: list[torch.Tensor], w2s: list[torch.Tensor]) -> None:
    for w13, w2 in zip(w13s, w2s):
        call(w13=w13, w2=w2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--shape",
        default="qwen3-30b-a3b",
        choices=[s for s in SHAPES if SHAPES[s].get("num_experts")],
        help="MoE model shape (default qwen3-30b-a3b)",
    )
    p.add_argument("--tp", type=int, default=1, help="benchmark one rank's slice of the intermediate dimension")
    p.add_argument("--path", choices=["fused", "decode", "both"], default="fused", help="which MoE path to time")
    p.add_argument("--tokens", type=int, nargs="+", help="token counts to time (default: 1-8192; 1 2 4 with decode)")
    p.add_argument("--tiles", help="BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,WARPS,STAGES for every token count")
    p.add_argument("--decode-tiles", help="BLOCK_I,BLOCK_H,BLOCK_N,BLOCK_K,WARPS_GATE_UP,WARPS_DOWN (decode path)")
    p.add_argument("--layers", type=int, default=1, help="layers of distinct weights per replay (the L2 cannot serve)")
    a = p.parse_args()
    paths = ["fused", "decode"] if a.path == "both" else [a.path]
    tokens_list = a.tokens or ([1, 2, 4] if "decode" in paths else FUSED_TOKENS)
    cfg = SHAPES[a.shape]
    experts, top_k, hidden = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    inter = cfg["moe_intermediate_size"] // a.tp
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w13s = [torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) * hidden**-0.5 for _ in range(a.layers)]
    w2s = [torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * inter**-0.5 for _ in range(a.layers)]
    w13, w2 = w13s[0], w2s[0]
    expert_bytes = 3 * hidden * inter * w13.element_size()
    fixed = MoeTiles(*map(int, a.tiles.split(","))) if a.tiles else None
    dtiles = (
        DecodeTiles(*map(int, a.decode_tiles.split(",")))
        if a.decode_tiles
        else decode_tiles(hidden, inter, top_k, dtype)
    )
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        logits = torch.randn(tokens, experts, device=dev, dtype=dtype)
        out = torch.empty_like(x)
        tiles = fixed or moe_tiles(tokens, top_k, experts, dtype)
        hit = experts * (1 - (1 - top_k / experts) ** tokens)
        nbytes = hit * expert_bytes + tokens * top_k * (2 * hidden + 3 * inter) * x.element_size()
        flops = 2 * tokens * top_k * 3 * hidden * inter
        calls = {
            "fused": functools.partial(fused_moe, x, logits, top_k=top_k, renormalize=True, out=out, tiles=tiles),
            "decode": functools.partial(fused_moe, x, logits, top_k=top_k, renormalize=True, out=out, tiles=dtiles),
        }
        fused_tiles = [tiles.block_m, tiles.block_n, tiles.block_k, tiles.group_m, tiles.num_warps, tiles.num_stages]
        times = {}
        for path in paths:
            run = functools.partial(_layers, calls[path], w13s, w2s)
            times[path] = us = graph_replay_us(run, a.layers, 20)
            row = {
                "path": path,
                "shape": a.shape,
                "tp": a.tp,
                "tokens": tokens,
                "us": round(us, 2),
                "tb_s": round(nbytes / us / 1e6, 3),
                "tflops": round(flops / us / 1e6, 1),
                "experts_hit": round(hit, 1),
                "tiles": fused_tiles if path == "fused" else list(dtiles),
            }
            if path == "decode":  # the decode path's numbers mean little if its output is wrong
                fused = fused_moe(x, logits, w13, w2, top_k, True, tiles=tiles).double()
                decode = fused_moe(x, logits, w13, w2, top_k, True, tiles=dtiles).double()
                row["rel_err_vs_fused"] = float(f"{((decode - fused).norm() / fused.norm()).item():.2e}")
            print(json.dumps(row), flush=True)
        if len(times) == 2:
            us = {f"{path}_us": round(t, 2) for path, t in times.items()}
            print(json.dumps({"tokens": tokens, **us, "decode/fused": round(times["decode"] / times["fused"], 3)}))


if __name__ == "__main__":
    main()
