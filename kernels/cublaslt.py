"""``x @ w.T`` through cuBLASLt with an algorithm of our choosing (CUDA only).

torch's matmul runs the library's default choice (the first of cuBLASLt's heuristic times the same), tuned for
common shapes; the decode products (16-256 rows against one rank's weight shard) fill 132 SMs in awkward waves,
and another of the heuristic's candidates (tile, split-K, cluster, stages) can be faster. This module calls the
library torch already loaded, through ctypes, so the candidates can be listed, timed and run (kernels/cublaslt_tune.py
chooses at start; kernels/cublaslt_fp8.py describes the FP8 products). The Python cost of a call (~10 us of
ctypes) is paid once, when a CUDA graph captures it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

# cublasLt.h / library_types.h constants
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_CONFIG_ATTRS = {"algo": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "stages": 6, "cluster": 8}
_REDUCTION_COMPUTE_TYPE = 2  # split-K partials summed in fp32 in the workspace (deterministic)
WORKSPACE_BYTES = 32 << 20


class Algo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: opaque, 8 x uint64."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _find_library() -> ctypes.CDLL:
    """The libcublasLt torch loaded (found in this process's memory map after a first bf16 matmul)."""
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "cublasLtMatmul"):
            return lib
    raise RuntimeError("libcublasLt is not loaded in this process (a CUDA build of torch loads it for bf16 matmuls)")


_lib: ctypes.CDLL | None = None
_handle = ctypes.c_void_p()
_workspace: dict[int, torch.Tensor] = {}


def _call(fn: str, *args) -> None:
    status = getattr(_lib, fn)(*args)
    if status != 0:
        raise RuntimeError(f"{fn} failed with cublasStatus {status}")


def _init() -> None:
    global _lib
    if _lib is None:
        _lib = _find_library()
        _call("cublasLtCreate", ctypes.byref(_handle))


@dataclass(slots=True)
class Problem:
    """Descriptors of one product shape: y[m, n] = x[m, k] @ w[n, k].T, row-major (column-major: w.T @ x.T)."""

    desc: ctypes.c_void_p
    a_layout: ctypes.c_void_p
    b_layout: ctypes.c_void_p
    c_layout: ctypes.c_void_p


_problems: dict[tuple[int, int, int, torch.dtype], Problem] = {}
_ALPHA, _BETA = ctypes.c_float(1.0), ctypes.c_float(0.0)


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype == torch.bfloat16:
        return _R_16BF
    if dtype == torch.float16:
        return _R_16F
    raise ValueError(f"cuBLASLt path takes bfloat16 or float16, not {dtype}")


def problem(m: int, n: int, k: int, dtype: torch.dtype) -> Problem:
    key = (m, n, k, dtype)
    if key in _problems:
        return _problems[key]
    code = _dtype_code(dtype)
    # A = w (k x n, op T), B = x (k x m), C = y (n x m)
    _problems[key] = Problem(matmul_desc(), layout(code, k, n, k), layout(code, k, m, k), layout(code, n, m, n))
    return _problems[key]


def matmul_desc() -> ctypes.c_void_p:
    """A matmul descriptor computing in float32 with A transposed (the weight, row-major [n, k])."""
    _init()
    desc = ctypes.c_void_p()
    _call("cublasLtMatmulDescCreate", ctypes.byref(desc), ctypes.c_int(_COMPUTE_32F), ctypes.c_int(_R_32F))
    set_attribute(desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
    set_attribute(desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
    return desc


def set_attribute(desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData) -> None:
    """One attribute of a matmul descriptor (``value`` a ctypes scalar of the attribute's type)."""
    _call("cublasLtMatmulDescSetAttribute", desc, ctypes.c_int(attr), ctypes.byref(value),
          ctypes.c_size_t(ctypes.sizeof(value)))  # fmt: skip


def layout(code: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    """A column-major matrix layout of data type ``code`` (library_types.h)."""
    handle = ctypes.c_void_p()
    _call("cublasLtMatrixLayoutCreate", ctypes.byref(handle), ctypes.c_int(code), ctypes.c_uint64(rows),
          ctypes.c_uint64(cols), ctypes.c_int64(ld))  # fmt: skip
    return handle


def heuristic_algos(m: int, n: int, k: int, dtype: torch.dtype, count: int = 32) -> list[Algo]:
    """cuBLASLt's candidates for this product, its first choice first (as fast as torch's matmul)."""
    return candidates(problem(m, n, k, dtype), count)


def candidates(p: Problem, count: int = 32) -> list[Algo]:
    """cuBLASLt's heuristic candidates for the product ``p`` describes, its first choice first."""
    _init()
    pref = ctypes.c_void_p()
    _call("cublasLtMatmulPreferenceCreate", ctypes.byref(pref))
    size = ctypes.c_uint64(WORKSPACE_BYTES)
    _call(
        "cublasLtMatmulPreferenceSetAttribute",
        pref,
        ctypes.c_int(_PREF_MAX_WORKSPACE_BYTES),
        ctypes.byref(size),
        ctypes.c_size_t(8),
    )
    results = (_HeuristicResult * count)()
    returned = ctypes.c_int(0)
    _call(
        "cublasLtMatmulAlgoGetHeuristic",
        _handle,
        p.desc,
        p.a_layout,
        p.b_layout,
        p.c_layout,
        p.c_layout,
        pref,
        ctypes.c_int(count),
        results,
        ctypes.byref(returned),
    )
    _lib.cublasLtMatmulPreferenceDestroy(pref)
    return [Algo.from_buffer_copy(results[i].algo) for i in range(returned.value) if results[i].state == 0]


def algo_config(algo: Algo) -> dict[str, int]:
    """The algorithm's id, tile, split-K, reduction, swizzle, stages and cluster ids (cublasLt enums)."""
    _init()
    config = {}
    for name, attr in _CONFIG_ATTRS.items():
        size = ctypes.c_size_t(0)  # asked first: the library checks the buffer size against the attribute's
        _lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), ctypes.c_int(attr), None, 0, ctypes.byref(size))
        if not 0 < size.value <= 8:
            continue
        value, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
        status = _lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), ctypes.c_int(attr), ctypes.byref(value), size, ctypes.byref(written)
        )
        if status == 0:
            config[name] = int(value.value) & ((1 << (8 * written.value)) - 1)
    return config


def with_split_k(p: Problem, algos: list[Algo], first: int = 2) -> list[Algo]:
    """``algos`` and, after them, the first ``first`` of them at other split-K counts: what the tuners time."""
    return algos + [v for a in algos[:first] for v in split_k_variants(a, p)]


def split_k_variants(algo: Algo, p: Problem, splits=(2, 3, 4, 6, 8)) -> list[Algo]:
    """``algo`` with other split-K counts (fp32 partials reduced in the workspace), those the library accepts for the
    product ``p`` describes."""
    variants = []
    own = algo_config(algo).get("split_k", 1)
    for split in splits:
        if split == own:
            continue
        variant = Algo.from_buffer_copy(algo)
        ok = True
        for attr, value in ((_CONFIG_ATTRS["split_k"], split), (_CONFIG_ATTRS["reduction"], _REDUCTION_COMPUTE_TYPE)):
            v = ctypes.c_uint32(value)
            status = _lib.cublasLtMatmulAlgoConfigSetAttribute(
                ctypes.byref(variant), ctypes.c_int(attr), ctypes.byref(v), ctypes.c_size_t(4)
            )
            ok = ok and status == 0
        result = _HeuristicResult()
        if ok and 0 == _lib.cublasLtMatmulAlgoCheck(
            _handle, p.desc, p.a_layout, p.b_layout, p.c_layout, p.c_layout, ctypes.byref(variant), ctypes.byref(result)
        ):
            if result.workspace_size <= WORKSPACE_BYTES:
                variants.append(variant)
    return variants


def lt_linear(x: torch.Tensor, w: torch.Tensor, algo: Algo, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` with ``algo`` on the current stream; x [m, k] and w [n, k] contiguous, same dtype."""
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    return matmul(problem(m, n, k, x.dtype), w, x, out, algo)


def matmul(p: Problem, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, algo: Algo) -> torch.Tensor:
    """cublasLtMatmul of the product ``p`` describes: A = ``a`` (the weight), B = ``b`` (the activations), into
    ``out`` (C and D), with ``algo`` and the device's workspace, on the current stream."""
    device = out.device.index
    if device not in _workspace:
        _workspace[device] = torch.empty(WORKSPACE_BYTES, device=out.device, dtype=torch.uint8)
    _call(
        "cublasLtMatmul",
        _handle,
        p.desc,
        ctypes.byref(_ALPHA),
        ctypes.c_void_p(a.data_ptr()),
        p.a_layout,
        ctypes.c_void_p(b.data_ptr()),
        p.b_layout,
        ctypes.byref(_BETA),
        ctypes.c_void_p(out.data_ptr()),
        p.c_layout,
        ctypes.c_void_p(out.data_ptr()),
        p.c_layout,
        ctypes.byref(algo),
        ctypes.c_void_p(_workspace[device].data_ptr()),
        ctypes.c_size_t(WORKSPACE_BYTES),
        ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream),
    )
    return out


def version() -> int:
    """The loaded cuBLASLt's version (an algorithm stored by kernels/tune_cache.py is only valid for the same one)."""
    _init()
    _lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return int(_lib.cublasLtGetVersion())


def check(p: Problem, algo: Algo) -> bool:
    """Whether the library accepts ``algo`` for the product ``p`` within our workspace (an algorithm read back)."""
    _init()
    result = _HeuristicResult()
    status = _lib.cublasLtMatmulAlgoCheck(
        _handle, p.desc, p.a_layout, p.b_layout, p.c_layout, p.c_layout, ctypes.byref(algo), ctypes.byref(result)
    )
    return status == 0 and result.workspace_size <= WORKSPACE_BYTES
