"""Is the one-row FP8 GEMV bound by its arithmetic? (GPU only; docs/PERFORMANCE_LOG.md log 42.)

The engine's GEMV over a row quantized in front (kernels/fp8_gemv.py, 16 KB programs) loads its first weight step
before the PDL wait; after the wait every resident program converts and multiplies at once. Built for sm_90a, a
thread does ~285 instructions for its 64 weights, 40 of them e4m3 -> float16 conversions (F2FP, a slow pipe on
Hopper). This probe times, per Qwen3-8B product and behind the RMSNorm as in a decode step (CUDA graph over 36
weights), variants of that kernel that differ only in their arithmetic:

- ``engine``: fp8_gemv as the engine calls it; ``same``: this file's copy of it (the copy loaded the channel scales
  before the wait first, and timed faster: the engine took that, log 42b);
- ``x16``: the row handed over as float16 (exact e4m3 values), no conversions for it;
- ``intcvt``: ``x16`` with the weights widened by integer ops (a byte permute, mask, shift, merge: 8 ALU ops per 4
  weights, exact, a factor 2^-8 folded into the row), not F2FP;
- ``mixed``: ``x16``, half a program's channels widened by F2FP and half by integer ops (two pipes at once);
- ``bytes``: the same loads with nearly no arithmetic (an integer sum of the weight words): the floor;
- ``defer``: each thread keeps its runs' float32 sums over the K steps and the threads sum them once, not once a step
  (down_proj's three steps: a third of the shuffles); ``x16defer``: both.

    python -m benchmarks.probes.gemv_compute [--products qkv o gate_up down] [--layers 36]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.decode_gemm import SHAPES
from benchmarks.gpu import require_cuda
from kernels import fp8_gemv, fused
from kernels.graph_timing import graph_replay_us
from kernels.pdl import pdl_enter
from model.fp8 import quantize_per_channel

_WIDEN_ASM = tl.constexpr("""{
.reg .b32 a<2>, b<2>;
prmt.b32 a0, 0, $2, 0x5040;
prmt.b32 a1, 0, $2, 0x7060;
and.b32 b0, a0, 0x7f007f00;
and.b32 b1, a1, 0x7f007f00;
shr.b32 b0, b0, 1;
shr.b32 b1, b1, 1;
lop3.b32 $0, b0, 0x80008000, a0, 0xf8;
lop3.b32 $1, b1, 0x80008000, a1, 0xf8;
}""")


@triton.jit
def _widened(w):
    """e4m3 ``w`` as float16 times 2^-8, exact (subnormals too): each byte's magnitude shifted into float16's
    exponent and mantissa, its sign kept."""
    return tl.inline_asm_elementwise(_WIDEN_ASM, "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _runs(w16, x16, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    prod = w16 * x16[None, :]
    return tl.sum(tl.reshape(prod, (ROWS, BLOCK_K // 8, 8)), axis=2).to(tl.float32)


@triton.jit
def _run_sums(w16, x16, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    return tl.sum(_runs(w16, x16, ROWS, BLOCK_K), axis=1)


@triton.jit
def _variant_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, xs_ptr, N, stride_wn,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    # MODE 0 same, 1 x16, 2 intcvt, 3 mixed, 4 bytes, 5 defer, 6 x16 + defer; x: e4m3 (0, 4, 5), float16 x/64 (1, 3,
    # 6), float16 4x (2)
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    HALF: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    if MODE == 3:  # even channels by F2FP, odd ones by integer ops
        ch_a = pid * BLOCK_N + tl.arange(0, HALF) * 2
        ch_b = ch_a + 1
        rows_a = w_ptr + ch_a[:, None].to(tl.int64) * stride_wn
        rows_b = w_ptr + ch_b[:, None].to(tl.int64) * stride_wn
        wa_first = tl.load(rows_a + offs_k[None, :], mask=(ch_a < N)[:, None], other=0.0)
        wb_first = tl.load(rows_b + offs_k[None, :], mask=(ch_b < N)[:, None], other=0.0)
    else:
        ch = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = w_ptr + ch[:, None].to(tl.int64) * stride_wn
        w_first = tl.load(rows + offs_k[None, :], mask=(ch < N)[:, None], other=0.0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    sw = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    pdl_enter(True)
    sx = tl.load(xs_ptr)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    iacc = tl.zeros([BLOCK_N], dtype=tl.int32)
    acc_a = tl.zeros([HALF], dtype=tl.float32)
    acc_b = tl.zeros([HALF], dtype=tl.float32)
    part = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    for s in tl.static_range(STEPS):
        ks = s * BLOCK_K + offs_k
        if MODE == 3:
            if s == 0:
                wa, wb = wa_first, wb_first
            else:
                wa = tl.load(rows_a + ks[None, :], mask=(ch_a < N)[:, None], other=0.0)
                wb = tl.load(rows_b + ks[None, :], mask=(ch_b < N)[:, None], other=0.0)
            x16 = tl.load(x_ptr + ks)
            acc_a += _run_sums(wa.to(tl.float16), x16, HALF, BLOCK_K)
            acc_b += _run_sums(_widened(wb), x16 * 256.0, HALF, BLOCK_K)
        else:
            w = w_first if s == 0 else tl.load(rows + ks[None, :], mask=(ch < N)[:, None], other=0.0)
            if MODE == 0:
                x16 = tl.load(x_ptr + ks).to(tl.float16) * 0.015625
                acc += _run_sums(w.to(tl.float16), x16, BLOCK_N, BLOCK_K)
            elif MODE == 1:
                acc += _run_sums(w.to(tl.float16), tl.load(x_ptr + ks), BLOCK_N, BLOCK_K)
            elif MODE == 2:
                acc += _run_sums(_widened(w), tl.load(x_ptr + ks), BLOCK_N, BLOCK_K)
            elif MODE == 5:
                part += _runs(w.to(tl.float16), tl.load(x_ptr + ks).to(tl.float16) * 0.015625, BLOCK_N, BLOCK_K)
            elif MODE == 6:
                part += _runs(w.to(tl.float16), tl.load(x_ptr + ks), BLOCK_N, BLOCK_K)
            else:
                iacc += tl.sum(w, axis=1)
    if MODE == 3:
        acc = tl.reshape(tl.join(acc_a, acc_b), (BLOCK_N,))
    if MODE == 4:
        acc = iacc.to(tl.float32)
    if MODE >= 5:  # the K steps' runs summed across threads once, not once a step
        acc = tl.sum(part, axis=1)
    tl.store(out_ptr + offs_n, (acc * 64.0 * sx * sw).to(out_ptr.dtype.element_ty), mask=offs_n < N)


MODES = {"same": 0, "x16": 1, "intcvt": 2, "mixed": 3, "bytes": 4, "defer": 5, "x16defer": 6}


def variant(mode: str, x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, out: torch.Tensor):
    """One row's product [1, N] by ``mode``'s kernel; ``x_q`` prepared by ``row_for``."""
    n, k = w_q.shape
    if mode == "bytes":
        w_q = w_q.view(torch.int32)
        k //= 4
    block_k = 1024 if mode == "bytes" else min(4096, k)
    block_n = 4 if mode == "bytes" else 16384 // block_k
    _variant_kernel[(triton.cdiv(n, block_n),)](
        x_q, w_q, w_s, out, x_s, n, w_q.stride(0), K=k, BLOCK_N=block_n, BLOCK_K=block_k, MODE=MODES[mode],
        num_warps=8, launch_pdl=True,
    )  # fmt: skip
    return out


def row_for(mode: str, x_q: torch.Tensor) -> torch.Tensor:
    """The row as ``mode`` reads it: e4m3, or its exact values as float16 scaled to keep 8 products in range."""
    if mode in ("x16", "mixed", "x16defer"):
        return x_q.to(torch.float16) / 64
    if mode == "intcvt":
        return x_q.to(torch.float16) * 4
    return x_q


PRODUCTS = dict(zip(("qkv", "o", "gate_up", "down"), SHAPES["qwen3-8b"][0]))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--products", nargs="+", default=list(PRODUCTS), choices=list(PRODUCTS), help="Qwen3-8B products")
    p.add_argument(
        "--layers",
        type=int,
        default=SHAPES["qwen3-8b"][1],
        help="weights a graph cycles through (more than the L2 holds)",
    )
    a = p.parse_args()
    require_cuda()
    device = torch.device("cuda")
    layers = a.layers
    rows = []
    for name in a.products:
        n, k = PRODUCTS[name]
        ws = [
            quantize_per_channel(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02) for _ in range(layers)
        ]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        norm_w = torch.ones(k, device=device, dtype=torch.bfloat16)
        x_q, x_s, _ = fused.rmsnorm_quantized(x, norm_w, 1e-6, None)
        out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
        ref = fp8_gemv.fp8_gemv(x_q, ws[0][0], ws[0][1], None, None, out.clone(), x_scales=x_s).float()
        row = {"product": name}
        for mode in ["engine", *MODES]:
            if mode != "engine" and mode != "bytes":  # how far from the engine's output (0: its bits)
                got = variant(mode, row_for(mode, x_q), x_s, *ws[0], out.clone()).float()
                row[f"{mode}_max_diff"] = (got - ref).abs().max().item()
            xm = row_for(mode, x_q)

            def run(mode=mode, xm=xm, ws=ws, x=x, norm_w=norm_w, out=out):
                for w_q, w_s in ws:
                    xq, xs, _ = fused.rmsnorm_quantized(x, norm_w, 1e-6, None)
                    if mode == "engine":
                        fp8_gemv.fp8_gemv(xq, w_q, w_s, None, None, out, x_scales=xs)
                    else:
                        variant(mode, xm, xs, w_q, w_s, out)

            row[mode] = round(graph_replay_us(run, layers), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'product':8s} " + " ".join(f"{m:>8s}" for m in ["engine", *MODES]) + "   (us a product, norm in front)")
    for row in rows:
        print(f"{row['product']:8s} " + " ".join(f"{row[m]:8.2f}" for m in ["engine", *MODES]))


if __name__ == "__main__":
    main()
