"""What the all-reduce benchmarks share (benchmarks/allreduce.py, benchmarks/allreduce_fused_norm.py): each rank's
reproducible input, the true sum every rank can compute alone, and a CUDA graph's time taken as the slowest rank's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.timing import replay_ms

KB, MB = 1024, 1024 * 1024


def rank_input(r: int, numel: int, dtype: torch.dtype, device, salt: int = 0) -> torch.Tensor:
    """Rank r's input, the same on every process (so each can compute the true sum without communicating)."""
    g = torch.Generator(device=device).manual_seed(1_000_003 * (salt + 1) + 7919 * r + numel)
    return torch.randn(numel, generator=g, dtype=torch.float32, device=device).to(dtype)


def truth(world: int, numel: int, dtype: torch.dtype, device, salt: int = 0) -> torch.Tensor:
    return sum(rank_input(r, numel, dtype, device, salt).double() for r in range(world))


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, world: int) -> bool:
    # a rounding to dtype per partial sum (the inputs' own roundings are already in `want`)
    tol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 2.0**-20) * (world - 1)
    err = (got.double() - want).abs()
    return bool((err <= tol * (want.abs() + 1)).all()) and bool(torch.isfinite(got).all())


def max_over_ranks(v: float, device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_graph(fn, numel, dtype, device, calls: int, replays: int) -> float:
    """us per call of ``fn`` on zeros, ``calls`` of them captured back to back in one graph; the slowest rank's."""
    z = torch.zeros(numel, dtype=dtype, device=device)
    fn(z)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn(z)
    torch.cuda.synchronize(device)
    dist.barrier()
    ms = replay_ms(g, replays)
    del g
    return max_over_ranks(ms * 1000 / calls, device)
