"""Device time of an already captured CUDA graph (kernels/graph_timing.py captures and times a chain of calls)."""

from __future__ import annotations

import torch


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 40) -> float:
    """Milliseconds per replay of an already captured graph, replayed back to back after three warm-ups."""
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays
