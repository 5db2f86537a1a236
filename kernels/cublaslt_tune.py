"""The start-up choice among cuBLASLt's algorithms for the decode graphs' bf16 products (kernels/cublaslt.py runs
them): each weight shape and row count timed under torch's matmul and every candidate, the fastest kept where it
wins by ``min_gain``; CUDA graphs captured afterwards run it (model/linear.py asks ``chosen_algo``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cublaslt import Algo, algo_config, candidates, lt_linear, problem, with_split_k
from kernels.graph_timing import graph_replay_us

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
) -> list[TunedProduct]:
    """For each weight shape (n, k) and row count, time torch's matmul and cuBLASLt's candidates (the first two also
    with other split-K counts) over that shape's weights (one per layer: more than the L2 holds, as a decode step
    reads them) in a CUDA graph; where a candidate is ``min_gain`` faster and matches torch's result, graphs captured
    later run it.
    ``skip(x, w)``: products another kernel takes."""
    records = []
    for (n, k), ws in weights.items():
        dtype, device = ws[0].dtype, ws[0].device
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            if skip is not None and skip(x, ws[0]):
                continue
            ref = F.linear(x, ws[0]).float()
            tol = 1e-2 * ref.abs().max().item() + 1e-3
            torch_us = _graph_us(F.linear, x, ws)
            best = (torch_us, None)
            p = problem(m, n, k, dtype)
            algos = with_split_k(p, candidates(p))
            for algo in algos:
                if (lt_linear(x, ws[0], algo).float() - ref).abs().max().item() > tol:
                    continue
                us = _graph_us(lambda x, w, algo=algo: lt_linear(x, w, algo), x, ws)
                if us < best[0]:
                    best = (us, algo)
            won = best[1] is not None and best[0] < torch_us * (1 - min_gain)
            if won:
                _chosen[m, n, k, dtype] = best[1]
            records.append(TunedProduct(m, n, k, len(ws), torch_us, best[0], algo_config(best[1]) if won else None))
    return records


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
