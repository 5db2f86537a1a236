"""FP8 products with per-token and per-channel scales through cuBLASLt with an algorithm of our choosing (CUDA only).

torch._scaled_mm runs cuBLASLt's first choice; at 2-128 rows that streams Qwen3-8B's e4m3 weights at ~1.95 TB/s,
no faster than the bf16 products (docs/PERFORMANCE_LOG.md log 21c). This module asks the library for its other
candidates of the same product (kernels/cublaslt.py does so for bf16): ``y[m, n] = (x_q[m, k] * x_s[m]) @ (w_q[n, k]
* w_s[n]).T`` in bf16, A = the weight (its scales an outer vector over the product's rows), B = the activations
(theirs over its columns). The constants are cublasLt.h's (CUDA 13: ``CUBLASLT_MATMUL_DESC_A_SCALE_POINTER`` 17,
``..._B_SCALE_POINTER`` 18, ``..._A_SCALE_MODE`` 31, ``..._B_SCALE_MODE`` 32, ``CUBLASLT_MATMUL_MATRIX_SCALE_
OUTER_VEC_32F`` 3; library_types.h: ``CUDA_R_8F_E4M3`` 28). The engine does not call this module: on CUDA 13
the heuristic offers one candidate, torch's own pick (docs/PERFORMANCE_LOG.md log 22b); the probe that timed them
re-asks a newer cuBLAS (``git show 228ce42:benchmarks/probes/lt_fp8_algos.py``).
"""

from __future__ import annotations

import ctypes

import torch

from kernels import cublaslt
from kernels.cublaslt import Algo, Problem

_R_8F_E4M3 = 28
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_OUTER_VEC_32F = 3
# the heuristic query is refused while the scale pointers are unset; it does not read them, so any aligned
# address serves until a product sets its own
_PLACEHOLDER_SCALES = 0x7F0000000000

_problems: dict[tuple[int, int, int, torch.dtype], Problem] = {}


def problem(m: int, n: int, k: int, out_dtype: torch.dtype = torch.bfloat16) -> Problem:
    """Descriptors of ``y[m, n] = x_q[m, k] @ w_q[n, k].T`` over e4m3 operands with outer-vector scales: as
    cublaslt.problem's, A = w (k x n, op T), B = x (k x m), C = y (n x m), column-major."""
    key = (m, n, k, out_dtype)
    if key in _problems:
        return _problems[key]
    desc = cublaslt.matmul_desc()
    for attr in (_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE):
        cublaslt.set_attribute(desc, attr, ctypes.c_int32(_SCALE_OUTER_VEC_32F))
    for attr in (_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER):
        cublaslt.set_attribute(desc, attr, ctypes.c_void_p(_PLACEHOLDER_SCALES))
    out_code = cublaslt._dtype_code(out_dtype)
    a, b = cublaslt.layout(_R_8F_E4M3, k, n, k), cublaslt.layout(_R_8F_E4M3, k, m, k)
    c = cublaslt.layout(out_code, n, m, n)
    _problems[key] = Problem(desc, a, b, c)
    return _problems[key]


def algos(m: int, n: int, k: int, count: int = 32) -> list[Algo]:
    """cuBLASLt's candidates for the product (its first choice first), then the first two at other split-K counts."""
    p = problem(m, n, k)
    return cublaslt.with_split_k(p, cublaslt.candidates(p, count))


def scaled_linear(
    x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, algo: Algo, out: torch.Tensor
) -> torch.Tensor:
    """``out = (x_q * x_s) @ (w_q * w_s).T`` with ``algo`` on the current stream: x_q [m, k] and w_q [n, k] e4m3,
    contiguous; x_s [m] and w_s [n] float32 (any shape of that many contiguous elements); out [m, n] 16-bit."""
    m, k = x_q.shape
    n = w_q.shape[0]
    assert x_q.is_contiguous() and w_q.is_contiguous() and x_s.numel() == m and w_s.numel() == n
    p = problem(m, n, k, out.dtype)
    cublaslt.set_attribute(p.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(w_s.data_ptr()))
    cublaslt.set_attribute(p.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(x_s.data_ptr()))
    return cublaslt.matmul(p, w_q, x_q, out, algo)
