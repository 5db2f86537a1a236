"""Does programmatic dependent launch (PDL) pay for decode at small batch? (GPU only, sm90+)

A batch-1 decode step is a chain of ~400 short kernels; each pays a launch gap, a ramp and a tail. With PDL a
kernel may start while its predecessor finishes, and do work that does not depend on it (load weights) before
``gdc_wait``. This times one Qwen3 layer's chain, 36 times over inside a CUDA graph (weights of every layer
distinct, more than L2 holds), three ways: cuBLAS GEMMs + Triton elementwise kernels (today), Triton GEMV +
elementwise without PDL, and the same with PDL.

    python benchmarks/pdl_chain.py [--shape qwen3-8b|qwen3-0.6b] [--rows 1]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

SHAPES = {  # hidden, qkv out, o in, intermediate, layers
    "qwen3-8b": (4096, 6144, 4096, 12288, 36),
    "qwen3-0.6b": (1024, 4096, 2048, 3072, 28),
}


@triton.jit
def _ew_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """y = x * 0.5 over one row (stands in for RMSNorm / SiLU-and-mul / q-k norm: one short memory-bound pass)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
    tl.store(y_ptr + offs, x * 0.5, mask=offs < N)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w = tl.load(w_ptrs)  # the first weight tile does not depend on the previous kernel: in flight during the wait
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
    acc = tl.dot(x, tl.trans(w), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
    for k in range(BLOCK_K, K, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs + k)
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def gemv(x, w, out, pdl: bool, tiles):
    block_n, block_k, warps, stages = tiles
    m, k = x.shape
    n = w.shape[0]
    _gemv_kernel[(n // block_n,)](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_PDL=pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=pdl,
    )


def ew(x, y, pdl: bool):
    n = x.numel()
    _ew_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)


def graph_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--rows", type=int, default=1)
    a = p.parse_args()
    hidden, qkv, o_in, inter, layers = SHAPES[a.shape]
    dev, dt = "cuda", torch.bfloat16
    shapes = [(qkv, hidden), (hidden, o_in), (2 * inter, hidden), (hidden, inter)]  # (N, K) per GEMM
    weights = [[torch.randn(n, k, device=dev, dtype=dt) * 0.02 for n, k in shapes] for _ in range(layers)]
    weight_bytes = sum(w.numel() * 2 for lw in weights for w in lw)
    xs = {k: torch.randn(a.rows, k, device=dev, dtype=dt) for _, k in shapes}
    outs = {n: torch.empty(a.rows, n, device=dev, dtype=dt) for n, _ in shapes}
    normed = {k: torch.empty(a.rows, k, device=dev, dtype=dt) for _, k in shapes}

    def chain(use_cublas: bool, pdl: bool, tiles, with_ew: bool = True):
        def run():
            for lw in weights:
                for (n, k), w in zip(shapes, lw):
                    if with_ew:
                        ew(xs[k], normed[k], pdl)
                    if use_cublas:
                        torch.matmul(xs[k], w.t(), out=outs[n])
                    else:
                        gemv(xs[k], w, outs[n], pdl, tiles)

        return run

    # correctness of the GEMV against cuBLAS
    for (n, k), w in zip(shapes, weights[0]):
        gemv(xs[k], w, outs[n], True, (32, 256, 4, 3))
        ref = F.linear(xs[k], w)
        assert (outs[n].float() - ref.float()).abs().max().item() < 5e-2, (n, k)

    floor_ms = weight_bytes / 4.2e9
    rows = {
        "cublas + ew": graph_ms(chain(True, False, None)),
        "cublas alone": graph_ms(chain(True, False, None, False)),
    }
    for tiles in [(32, 256, 4, 3), (16, 256, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3), (16, 512, 4, 2)]:
        for pdl in (False, True):
            try:
                rows[f"gemv{tiles} pdl={pdl} + ew"] = graph_ms(chain(False, pdl, tiles))
            except Exception as e:  # noqa: BLE001 (a tiling that does not fit)
                print(f"{tiles} pdl={pdl}: {type(e).__name__}: {str(e)[:100]}")
    ew_chain = {
        pdl: graph_ms(lambda pdl=pdl: [ew(xs[hidden], outs[hidden], pdl) for _ in range(400)]) for pdl in (0, 1)
    }
    print(f"{a.shape} rows {a.rows}: {layers} layers, {weight_bytes / 1e9:.2f} GB of weights, floor {floor_ms:.3f} ms")
    for name, ms in sorted(rows.items(), key=lambda kv: kv[1]):
        print(f"  {ms:8.3f} ms  {name}")
    print(f"  400 elementwise kernels: {ew_chain[0] * 1e3 / 400:.2f} us each, with PDL {ew_chain[1] * 1e3 / 400:.2f}")
    print(json.dumps({"shape": a.shape, "rows": rows, "ew_us": ew_chain}))


if __name__ == "__main__":
    main()
