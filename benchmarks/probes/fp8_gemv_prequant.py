"""Would a one-row FP8 GEMV on a row quantized beforehand (by the norm or SiLU in front) stream like the bf16 GEMV?

    python -m benchmarks.probes.fp8_gemv_prequant [--slices 4096 8192 16384 32768]

The engine's FP8 GEMV (kernels/fp8_gemv.py) quantizes the row itself in every program, so its programs carry 32 KB
of weight to share that work. Here the row arrives as e4m3 values and a scale, and each program only multiplies
its whole weight slice (every K step loaded before the PDL wait) and sums, as the bf16 GEMV does with 16 KB. Per
Qwen3-8B product, us behind an RMSNorm in a CUDA graph over 36 layers (benchmarks/fp8_gemm.py's step_us):
"engine" (fp8_gemv, 32 KB), "quant+gemv_S" (kernels/fp8_quant.py's row kernel, then this GEMV with S-byte
slices: a launch more), "pre_S" (the row quantized outside the graph: what a norm writing e4m3 could reach).
Answered in docs/PERFORMANCE_LOG.md log 29b (H200): at best 4.4% off the GEMVs, and less than a launch costs.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.decode_gemm import SHAPES
from benchmarks.fp8_gemm import step_us
from benchmarks.gpu import require_cuda
from kernels import fp8_gemv
from kernels.fp8_quant import quantize_rows
from kernels.pdl import pdl_enter, use_pdl
from model.fp8 import quantize_per_channel


@triton.jit
def _gemv_quantized_row_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr
):
    # one e4m3 row and its scale, per-channel weight scales, K = 4096 x (1 to 3): the whole slice before the wait
    STEPS: tl.constexpr = K // 4096
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 4096)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w0 = tl.load(rows)
    if STEPS > 1:
        w1 = tl.load(rows + 4096)
    if STEPS > 2:
        w2 = tl.load(rows + 8192)
    pdl_enter(USE_PDL)
    acc = tl.sum(w0.to(tl.float32) * tl.load(xq_ptr + offs_k).to(tl.float32)[None, :], axis=1)
    if STEPS > 1:
        acc += tl.sum(w1.to(tl.float32) * tl.load(xq_ptr + 4096 + offs_k).to(tl.float32)[None, :], axis=1)
    if STEPS > 2:
        acc += tl.sum(w2.to(tl.float32) * tl.load(xq_ptr + 8192 + offs_k).to(tl.float32)[None, :], axis=1)
    acc = acc * tl.load(xs_ptr) * tl.load(ws_ptr + offs_n)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty))


def gemv_quantized_row(x_q, x_s, w_q, w_s, out, slice_bytes: int, warps: int = 8) -> torch.Tensor:
    """``out = x_q * x_s @ (w_q * w_s).T`` for one e4m3 row with its scale, per-channel weight scales, N a
    multiple of the slice's channels."""
    n, k = w_q.shape
    assert k % 4096 == 0 and k <= 3 * 4096, k
    block_n = max(1, slice_bytes // k)
    pdl = use_pdl(x_q)
    _gemv_quantized_row_kernel[(triton.cdiv(n, block_n),)](
        x_q, x_s, w_q, w_s, out, n, w_q.stride(0), K=k, BLOCK_N=block_n, USE_PDL=pdl, num_warps=warps, launch_pdl=pdl
    )
    return out


def time_shape(n: int, k: int, layers: int, slices: list[int], warps: list[int]) -> dict:
    device = torch.device("cuda")
    ws = [quantize_per_channel(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02) for _ in range(layers)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(1, n, device=device, dtype=x.dtype)
    pre_q, pre_s = quantize_rows(x, None)

    row = {
        "shape": [n, k],
        "engine": step_us(lambda h, w_q, w_s: fp8_gemv.fp8_gemv(h, w_q, w_s, None, None, out), ws, x),
    }
    for s in slices:
        for wp in warps:
            row[f"quant+gemv_{s}_{wp}"] = step_us(
                lambda h, w_q, w_s, s=s, wp=wp: gemv_quantized_row(*quantize_rows(h, None), w_q, w_s, out, s, wp), ws, x
            )
            row[f"pre_{s}_{wp}"] = step_us(
                lambda h, w_q, w_s, s=s, wp=wp: gemv_quantized_row(pre_q, pre_s, w_q, w_s, out, s, wp), ws, x
            )
    # the same numbers as the engine's GEMV (both sum exact e4m3 products in float32)
    ref = fp8_gemv.fp8_gemv(x, *ws[0], None, None, torch.empty_like(out))
    got = gemv_quantized_row(pre_q, pre_s, *ws[0], torch.empty_like(out), 8192)
    row["max_rel_diff"] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--slices", type=int, nargs="+", default=[4096, 8192, 16384, 32768], help="weight bytes a program")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="warps a program")
    a = p.parse_args()
    require_cuda()
    layer_shapes, layers = SHAPES["qwen3-8b"]
    totals: dict[str, float] = {}
    for n, k in layer_shapes:
        row = time_shape(n, k, layers, a.slices, a.warps)
        print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
        for key, v in row.items():
            if isinstance(v, float) and key != "max_rel_diff":
                totals[key] = totals.get(key, 0.0) + v * layers
    print(json.dumps({"per_step_us": {key: round(v, 1) for key, v in sorted(totals.items(), key=lambda kv: kv[1])}}))


if __name__ == "__main__":
    main()
