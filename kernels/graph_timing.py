"""Device time of a CUDA-graph replay: how the start-up tuner (kernels/cublaslt_tune.py) and the benchmarks time
chains of kernels without launch overhead."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_replay_us(run: Callable[[], None], calls: int, replays: int = 10) -> float:
    """Microseconds per call of ``run`` (which makes ``calls`` calls), captured once into a CUDA graph after a
    warm-up (compiles) and replayed ``replays`` times; the median replay counts."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]
