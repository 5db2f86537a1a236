"""The start-up choice among cuBLASLt's algorithms for the decode graphs' bf16 products (kernels/cublaslt.py runs
them): each weight shape and row count timed under torch's matmul and every candidate, the fastest kept where it
wins by ``min_gain``; CUDA graphs captured afterwards run it (model/linear.py asks ``chosen_algo``). The choices
are kept across starts (kernels/tune_cache.py): a second start on the same GPU, driver and code times nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kernels.cublaslt import Algo, algo_config, candidates, check, lt_linear, problem, with_split_k
from kernels.graph_timing import graph_replay_us
from kernels.tune_cache import TuneCache, code_hash, cuda_device_key

# (rows, n, k, dtype) -> the algorithm CUDA graphs capture for that product (filled by ``tune``)
_chosen: dict[tuple[int, int, int, torch.dtype], Algo] = {}


def chosen_algo(x: torch.Tensor, w: torch.Tensor) -> Algo | None:
    """The tuned algorithm for ``x @ w.T`` while a CUDA graph is being captured, else None (torch's matmul:
    eager calls would pay ctypes' ~10 us each)."""
    if not _chosen or x.dim() != 2:
        return None
    algo = _chosen.get((x.shape[0], w.shape[0], w.shape[1], x.dtype))
    if algo is None or not torch.cuda.is_current_stream_capturing():
        return None
    if x.stride() != (x.shape[1], 1) or not w.is_contiguous():
        return None
    return algo


# Products are timed over enough of a shape's weights to exceed any GPU's L2 several times over, as a decode step
# reads them, not over every layer's: an 8B model's 36 layers made a product take ~0.25 s to time (18 s a cold
# start), and most of that was replaying the same shape 36 times.
TIMING_BYTES = 256 << 20


def timing_weights(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first of ``ws`` that together hold TIMING_BYTES (at least two, at most all)."""
    size = ws[0].numel() * ws[0].element_size()
    return ws[: max(2, -(-TIMING_BYTES // size))]


def _graph_us(product: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per ``product(x, w)`` over ``weights``, replayed in a CUDA graph."""

    def run() -> None:
        for w in weights:
            product(x, w)

    return graph_replay_us(run, len(weights), replays=5)


@dataclass(slots=True)
class TunedProduct:
    rows: int
    n: int
    k: int
    layers: int  # weights of this shape: the product runs this many times per step
    torch_us: float
    best_us: float
    config: dict[str, int] | None  # None: torch's matmul kept


def tune(
    weights: dict[tuple[int, int], list[torch.Tensor]],
    rows: Iterable[int],
    min_gain: float = 0.02,
    skip: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
    cache: TuneCache | None = None,
    budget_s: float | None = None,
) -> list[TunedProduct]:
    """For each weight shape (n, k) and row count, time torch's matmul and cuBLASLt's candidates (the first two also
    with other split-K counts) over that shape's weights (``timing_weights``: more than the L2 holds, as a decode
    step reads them) in a CUDA graph; where a candidate is ``min_gain`` faster and matches torch's result, graphs
    captured later run it.
    ``skip(x, w)``: products another kernel takes. ``cache``: choices stored by an earlier start (kernels/tune_cache.py,
    keyed by ``cache_key``), each checked by the library and against torch's result before it is used; the products
    it lacks are timed and stored. ``budget_s`` (with a cache): once tuning has taken that long, products the cache
    lacks keep torch's matmul and are left for a later start (counted in ``cache.deferred``), so a cold start pays
    a few seconds and each start fills in more; the largest row counts go first."""
    records = []
    deadline = None if budget_s is None or cache is None else time.perf_counter() + budget_s
    for m in sorted(rows, reverse=True):
        for (n, k), ws in weights.items():
            dtype = ws[0].dtype
            x = torch.randn(m, k, device=ws[0].device, dtype=dtype)
            if skip is not None and skip(x, ws[0]):
                continue
            name = f"{m}x{n}x{k} {str(dtype).removeprefix('torch.')} layers={len(ws)} min_gain={min_gain}"
            if deadline is not None and cache.get(name) is None and time.perf_counter() > deadline:
                cache.deferred += 1
                continue
            timed = partial(_time_product, x, timing_weights(ws), min_gain)
            entry = timed() if cache is None else cache.lookup(name, timed, partial(_usable, x=x, w=ws[0]))
            algo = _algo_of(entry)
            if algo is not None:
                _chosen[m, n, k, dtype] = algo
            config = algo_config(algo) if algo is not None else None
            records.append(TunedProduct(m, n, k, len(ws), entry["torch_us"], entry["best_us"], config))
    if cache is not None:
        cache.save()
    return records


def cache_key(device: torch.device) -> dict[str, str]:
    """What the choices depend on: the GPU, driver, torch and CUDA, cuBLASLt's version and this code's."""
    from kernels import cublaslt, graph_timing

    modules = [sys.modules[__name__], cublaslt, graph_timing]
    return {**cuda_device_key(device), "cublaslt": str(cublaslt.version()), "code": code_hash(modules)}


def _time_product(x: torch.Tensor, ws: list[torch.Tensor], min_gain: float) -> dict:
    """Torch's matmul and every candidate timed for ``x @ w.T`` over ``ws``: the stored entry of the product,
    {"torch_us", "best_us", "algo": the winner's bytes in hex, or None where torch's matmul stays}."""
    m, k = x.shape
    ref = F.linear(x, ws[0]).float()
    tol = 1e-2 * ref.abs().max().item() + 1e-3
    torch_us = _graph_us(F.linear, x, ws)
    best = (torch_us, None)
    p = problem(m, ws[0].shape[0], k, x.dtype)
    for algo in with_split_k(p, candidates(p)):
        if (lt_linear(x, ws[0], algo).float() - ref).abs().max().item() > tol:
            continue
        us = _graph_us(lambda x, w, algo=algo: lt_linear(x, w, algo), x, ws)
        if us < best[0]:
            best = (us, algo)
    won = best[1] is not None and best[0] < torch_us * (1 - min_gain)
    return {"torch_us": torch_us, "best_us": best[0], "algo": bytes(best[1]).hex() if won else None}


def _algo_of(entry: dict) -> Algo | None:
    return None if entry["algo"] is None else Algo.from_buffer_copy(bytes.fromhex(entry["algo"]))


def _usable(entry: dict, *, x: torch.Tensor, w: torch.Tensor) -> bool:
    """A stored entry is used only if well formed, accepted by the library for this product and, run once, within
    the tuner's tolerance of torch's result (a damaged file costs a re-timing, never a wrong product)."""
    if not all(isinstance(entry[f], float | int) for f in ("torch_us", "best_us")):
        return False
    algo = _algo_of(entry)  # ValueError on a bad hex string or length: the cache recomputes
    if algo is None:
        return True
    if not check(problem(x.shape[0], w.shape[0], x.shape[1], x.dtype), algo):
        return False
    ref = F.linear(x, w).float()
    return (lt_linear(x, w, algo).float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item() + 1e-3


def summary(records: list[TunedProduct]) -> str:
    """How many products changed, and the layer products' ms per step before -> after, by row count."""
    per_rows: dict[int, list[float]] = {}
    for r in records:
        step = per_rows.setdefault(r.rows, [0.0, 0.0])
        step[0] += r.torch_us * r.layers
        step[1] += (r.best_us if r.config else r.torch_us) * r.layers
    changed = sum(r.config is not None for r in records)
    by_rows = " ".join(f"{m}:{t / 1e3:.3f}->{b / 1e3:.3f}" for m, (t, b) in sorted(per_rows.items()))
    changed_text = f"{changed} of {len(records)} products on cuBLASLt's other algorithms"
    return f"{changed_text}; layer GEMM ms per step by rows: {by_rows}"
