"""Which kernels a pipelined decode step waits on, with PDL on (GPU only): each kernel's share of the step's
critical path, not its own duration.

    python -m benchmarks.step_timeline --shape qwen3-8b --quantization fp8 [--batch 1] [--context 512]

Under PDL a kernel is scheduled while the one in front still runs, so kernel durations overlap and their sum says
little. It walks one profiled window's kernels in start order and charges each the time by which it moved
the device's frontier (the latest end so far): ``ahead`` is that share, ``idle`` the gap before it when nothing
ran. Kernels are named by their function and, for the GEMVs, by their neighbours (qkv sits between a norm and the
q/k norm + RoPE, down behind the SiLU), so the four products of a layer are told apart. The shares add up to
the window; the ``ms/step`` it also prints without the profiler says how much the profiler stretches it.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.profile_step import make_runner, pipelined_decode, prefill_prompts


def kernel_spans(prof) -> list[tuple[float, float, str]]:
    """(start, end, short name) of every device kernel in the profile, in start order (us)."""
    spans = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name.split("(")[0].split("<")[0][:48]
        spans.append((ev.time_range.start, ev.time_range.end, name))
    return sorted(spans)


def label(names: list[str], i: int) -> str:
    """A kernel's name, with its neighbours' for the GEMV-like kernels that run several products a layer."""
    name = names[i]
    if "gemv" not in name and "gemm" not in name:
        return name
    prev = names[i - 1] if i else ""
    nxt = names[i + 1] if i + 1 < len(names) else ""
    return f"{name} [{prev[:22]} -> {nxt[:22]}]"


def critical_path(spans: list[tuple[float, float, str]]) -> tuple[dict[str, list[float]], float]:
    """Per label: [share of the critical path, idle before it, summed duration, count]; and the window (us). The
    shares and idles add up to the window."""
    names = [s[2] for s in spans]
    rows: dict[str, list[float]] = {}
    frontier = spans[0][0]
    for i, (start, end, _) in enumerate(spans):
        r = rows.setdefault(label(names, i), [0.0, 0.0, 0.0, 0])
        r[1] += max(0.0, start - frontier)
        r[0] += max(0.0, end - max(frontier, start))
        r[2] += end - start
        r[3] += 1
        frontier = max(frontier, end)
    return rows, frontier - spans[0][0]


def print_ledger(spans: list[tuple[float, float, str]], steps: int) -> None:
    """Each label's share of the critical path, idle share and mean duration, per step, largest first."""
    rows, window = critical_path(spans)
    print(f"window {window / steps / 1e3:.3f} ms/step, {len(spans) / steps:.0f} kernels/step")
    print(f"{'ahead us':>9s} {'idle us':>8s} {'mean dur':>9s} {'n/step':>7s}  kernel")
    for key, (ahead, idle, dur, n) in sorted(rows.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        print(f"{ahead / steps:9.1f} {idle / steps:8.1f} {dur / n:9.2f} {n / steps:7.1f}  {key}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shape", default="qwen3-8b", help="model shape (random weights)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence before the timed steps")
    p.add_argument("--quantization", choices=["fp8"], help="FP8 linear layers (quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an e4m3 KV cache")
    p.add_argument("--steps", type=int, default=10, help="profiled steps")
    a = p.parse_args()
    blocks_per_seq = (a.context + 512) // 16 + 1
    runner = make_runner(a.shape, a.batch, a.batch * blocks_per_seq, a.quantization, a.kv_cache_dtype, False)
    slots = list(range(a.batch))
    blocks = [[s * blocks_per_seq + j for j in range(blocks_per_seq)] for s in slots]
    prefill_prompts(runner, slots, a.context, blocks)
    sid = pipelined_decode(runner, slots, 20, 1)  # warm
    torch.cuda.synchronize()
    runner.num_computed[slots] = a.context  # each phase from the same contexts
    t0 = time.perf_counter()
    sid = pipelined_decode(runner, slots, 100, sid)
    print(f"pipelined, no profiler: {(time.perf_counter() - t0) * 10:.3f} ms/step")
    runner.num_computed[slots] = a.context
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        pipelined_decode(runner, slots, a.steps, sid)
    print_ledger(kernel_spans(prof), a.steps)


if __name__ == "__main__":
    main()
