"""Host time to issue the pieces of an eager prefill step on a CUDA device (us per call, no synchronization
inside the timed loop; the device runs behind): a cuBLAS linear at prefill size with each BLAS library, one
Triton launch through the JIT (our residual-add + RMSNorm) against the compiled kernel launched directly, and
the replay of a small CUDA graph. It sizes the fixes for host-bound mixed prefill steps (docs/PERF.md log 10).

    python benchmarks/host_overhead.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.fused import _rmsnorm_kernel, rmsnorm  # noqa: E402


def host_us(fn, n: int = 200) -> float:
    """Mean host issue time per call over ``n`` calls, after a synchronized warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> None:
    dev = torch.device("cuda")
    rows: list[tuple[str, float]] = []
    x = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3072, 1024, device=dev, dtype=torch.bfloat16)
    for lib in ("cublaslt", "cublas"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
            rows.append((f"F.linear 8192x1024 @ 1024x3072 ({lib})", host_us(lambda: torch.nn.functional.linear(x, w))))
        except Exception as e:  # noqa: BLE001
            rows.append((f"F.linear ({lib}): {type(e).__name__}: {e}"[:70], float("nan")))
    torch.backends.cuda.preferred_blas_library("cublaslt")
    small = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    rows.append(("F.linear 256x1024 @ 1024x3072", host_us(lambda: torch.nn.functional.linear(small, w))))
    rows.append(("torch.empty_like(x)", host_us(lambda: torch.empty_like(x))))

    h, r = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16), torch.randn_like(x)
    weight = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    rows.append(("kernels.fused.rmsnorm (wrapper + JIT launch)", host_us(lambda: rmsnorm(h, weight, 1e-6, r))))
    out, res_out = torch.empty_like(h), torch.empty_like(h)
    args = (h, r, weight, out, res_out, h.stride(0), r.stride(0), out.stride(0), res_out.stride(0), 1024, 1e-6)
    consts = dict(HAS_RESIDUAL=True, BLOCK=1024, USE_PDL=False, num_warps=4)
    rows.append(
        ("_rmsnorm_kernel[grid](...) (JIT launch only)", host_us(lambda: _rmsnorm_kernel[(8192,)](*args, **consts)))
    )
    kernel = _rmsnorm_kernel[(8192,)](*args, **consts)
    try:
        stream = torch.cuda.current_stream().cuda_stream
        bound = (*args, True, 1024, False)  # every parameter in signature order, constexprs included

        def direct():
            kernel.run(8192, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *bound)

        rows.append(("CompiledKernel.run (direct launch)", host_us(direct)))
    except Exception as e:  # noqa: BLE001
        rows.append((f"direct launch: {type(e).__name__}: {e}"[:70], float("nan")))

    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rmsnorm(h, weight, 1e-6, r)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(10):
            rmsnorm(h, weight, 1e-6, r)
    rows.append(("CUDAGraph.replay, 10 kernels", host_us(graph.replay)))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    for name, us in rows:
        print(f"{name:60s} {us:8.1f} us")


if __name__ == "__main__":
    main()
