"""FP8 linear layers against bf16 on Qwen3 shapes (GPU only): where each FP8 path wins, to set the rows the GEMV
takes (kernels/fp8_gemm.py GEMV_ROWS) and which kernel takes the larger products.

    python -m benchmarks.fp8_gemm [--shape qwen3-8b|qwen3-0.6b|qwen3-8b-tp2] [--rows 1 2 4 8 16 32 64 256 1024]
        [--sweep] [--only PATH ...]

Per (layer shape, rows), microseconds per product inside a CUDA graph over one weight per model layer (more than the
L2 holds), each product behind an RMSNorm as in a decode step: bf16 (F.linear, what the 16-bit model runs without our
decode kernels); the FP8 GEMV that quantizes the rows itself ("gemv", up to four rows; candidates: "gemv_32k" with
twice the weight a program, "gemv_f16" multiplying and summing runs of 8 in float16, per-channel scales only); our
Triton FP8 GEMM after kernels/fp8_quant.py ("triton"; with --sweep also at other tilings); torch._scaled_mm after that
pass ("cublaslt", per-channel and block scales); what fp8_linear picks ("auto"); and the GEMV on rows the norm in
front quantized at several tilings ("qgemv*", quantized_paths). ``--only gemv cublaslt`` times just the paths whose
names start so. One JSON line per row count, then the per-step totals.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.decode_gemm import SHAPES
from kernels import fp8_gemm, fp8_gemv, fused, scaled_mm
from kernels.fp8_quant import quantize_rows
from kernels.graph_timing import graph_replay_us
from model.fp8 import quantize_blocks, quantize_per_channel


def paths(block):
    group = None if block is None else block[1]

    def gemv(x, w_q, w_s, slice_bytes=16384, f16_sums=False, max_block_k=4096):
        out = torch.empty(x.shape[0], w_q.shape[0], **_like(x))
        return fp8_gemv.fp8_gemv(x, w_q, w_s, block, None, out, slice_bytes, f16_sums, max_block_k)

    def triton(x, w_q, w_s):
        x_q, x_s = quantize_rows(x, group)
        return fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, block, None, torch.empty(x.shape[0], w_q.shape[0], **_like(x)))

    def cublaslt(x, w_q, w_s):
        x_q, x_s = quantize_rows(x, group)
        return scaled_mm.scaled_mm(x_q, x_s, w_q, w_s, block, None, torch.empty(x.shape[0], w_q.shape[0], **_like(x)))

    def tiled(tiles):
        def run(x, w_q, w_s):
            x_q, x_s = quantize_rows(x, group)
            out = torch.empty(x.shape[0], w_q.shape[0], **_like(x))
            return fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, block, None, out, tiles)

        return run

    sweep = {f"tiles{'x'.join(map(str, t))}": tiled(t) for t in TILE_SWEEP}
    return sweep | {
        "gemv": gemv,
        "gemv_32k": lambda x, w_q, w_s: gemv(x, w_q, w_s, 32768),  # twice the channels share a row's quantization
        "gemv_f16": lambda x, w_q, w_s: gemv(x, w_q, w_s, f16_sums=True),  # per-channel only: float16 sums of 8
        "gemv_f16_32k": lambda x, w_q, w_s: gemv(x, w_q, w_s, 32768, True),
        "gemv_64k": lambda x, w_q, w_s: gemv(x, w_q, w_s, 65536),  # 16 channels a program
        # 16 KB steps 1,024 or 2,048 wide: 16 or 8 channels a program share the row's amax pass and quantization
        "gemv_k1024": lambda x, w_q, w_s: gemv(x, w_q, w_s, 16384, False, 1024),
        "gemv_k2048": lambda x, w_q, w_s: gemv(x, w_q, w_s, 16384, False, 2048),
        "gemv_f16_k1024": lambda x, w_q, w_s: gemv(x, w_q, w_s, 16384, True, 1024),
        "gemv_f16_k2048": lambda x, w_q, w_s: gemv(x, w_q, w_s, 16384, True, 2048),
        "gemv_f16_32k_k1024": lambda x, w_q, w_s: gemv(x, w_q, w_s, 32768, True, 1024),
        "gemv_f16_8k_k1024": lambda x, w_q, w_s: gemv(x, w_q, w_s, 8192, True, 1024),
        "triton": triton,
        "cublaslt": cublaslt,
        "auto": lambda x, w_q, w_s: fp8_gemm.fp8_linear(x, w_q, w_s, block),
    }


# (BLOCK_M, BLOCK_N, warps, stages, K splits) our Triton GEMM is also timed with (--sweep)
TILE_SWEEP = [(16, 64, 4, 4, 1), (64, 64, 4, 4, 1), (64, 128, 4, 4, 1), (128, 64, 4, 4, 1), (64, 64, 4, 4, 2)]


def _like(x: torch.Tensor) -> dict:
    return {"dtype": x.dtype, "device": x.device}


def quantized_paths() -> dict:
    """The GEMV on e4m3 rows quantized by the RMSNorm in front, as the engine runs one-row products behind a norm
    (per-channel scales): the engine's tiling ("qgemv", fp8_gemv.default_tiling) and others, named by slice bytes a
    step and step width ("_k1024": 16 KB steps of 16 channels, so a program streams 4 steps of a 4,096-wide row)."""

    def run(slice_bytes: int | None, max_block_k: int | None):
        def gemv(x_q, x_s, w_q, w_s):
            out = torch.empty(x_q.shape[0], w_q.shape[0], dtype=torch.bfloat16, device=x_q.device)
            return fp8_gemv.fp8_gemv(x_q, w_q, w_s, None, None, out, slice_bytes, None, max_block_k, x_scales=x_s)

        return gemv

    tilings = {
        "": (None, None),
        "_k4096": (16384, 4096),
        "_8k": (8192, 4096),
        "_k2048": (16384, 2048),
        "_k1024": (16384, 1024),
        "_8k_k1024": (8192, 1024),
        "_8k_k512": (8192, 512),
        "_32k_k2048": (32768, 2048),
    }
    return {f"qgemv{suffix}": run(*tiling) for suffix, tiling in tilings.items()}


def quantized_step_us(fn, weights, x) -> float:
    """Microseconds per product of fn(rmsnorm_quantized(x), *weight) over every layer's weight."""
    norm_w = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)

    def run():
        for w in weights:
            x_q, x_s, _ = fused.rmsnorm_quantized(x, norm_w, 1e-6, None)
            fn(x_q, x_s, *w)

    return graph_replay_us(run, len(weights))


def step_us(fn, weights, x) -> float:
    """Microseconds per product of fn(rmsnorm(x), *weight) over every layer's weight."""
    norm_w = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)

    def run():
        for w in weights:
            fn(fused.rmsnorm(x, norm_w, 1e-6), *w)

    return graph_replay_us(run, len(weights))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES), help="model shape (default qwen3-8b)")
    p.add_argument(
        "--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024], help="row counts (tokens) to time"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time our Triton GEMM at each of TILE_SWEEP's tiles (per-channel scales)",
    )
    p.add_argument("--only", nargs="+", default=None, help="time only the paths whose names start with these")
    a = p.parse_args()
    device = torch.device("cuda")
    scaled_mm.probe_scaled_mm(device)  # outside the graphs, as model loading does
    layer_shapes, layers = SHAPES[a.shape]
    totals: dict[int, dict[str, float]] = {}
    for n, k in layer_shapes:
        w = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        variants = {
            "channel": [quantize_per_channel(t) for t in w],
            "block": [quantize_blocks(t, (128, 128)) for t in w],
        }
        for m in a.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row = {"shape": [n, k], "rows": m, "bf16": step_us(lambda x, t: F.linear(x, t), [(t,) for t in w], x)}
            for scheme, ws in variants.items():
                block = None if scheme == "channel" else (128, 128)
                for name, fn in paths(block).items():
                    if name == "cublaslt" and (not scaled_mm.uses_scaled_mm(n, k, block, device) or (block and m % 4)):
                        continue
                    if name.startswith("tiles") and (not a.sweep or block is not None):
                        continue
                    if a.only and not name.startswith(tuple(a.only)):
                        continue
                    if "f16" in name and block is not None:
                        continue
                    if name.startswith("gemv") and not fp8_gemv.supports(m, k, block):
                        continue
                    row[f"{scheme}_{name}"] = step_us(fn, ws, x)
                if scheme == "channel" and fp8_gemv.supports(m, k, None):
                    for name, fn in quantized_paths().items():
                        if not a.only or name.startswith(tuple(a.only)):
                            row[f"{scheme}_{name}"] = quantized_step_us(fn, ws, x)
            print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
            tot = totals.setdefault(m, {})
            for key, v in row.items():
                if isinstance(v, float):
                    tot[key] = tot.get(key, 0.0) + v * layers
    for m, tot in totals.items():
        print(json.dumps({"rows": m, "per_step_us": {key: round(v, 1) for key, v in tot.items()}}))


if __name__ == "__main__":
    main()
