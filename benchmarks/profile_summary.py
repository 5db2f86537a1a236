"""Summaries of a torch profiler trace of worker steps: device time by kernel, and device idle time by the kernel
before each gap (benchmarks/profile_step.py prints both)."""

from __future__ import annotations

import torch


def kernel_summary(prof, steps: int) -> None:
    """Device time per step grouped by kernel name, and the kernel count: the ledger a step's time is spent in."""
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            # torch's own kernels differ only past their template prefix: keep the functor's name
            name = ev.name[:70] if "at::native::" not in ev.name else ev.name.split("<", 1)[-1][:160]
            t = totals.setdefault(name, [0.0, 0])
            t[0] += ev.device_time
            t[1] += 1
    busy = sum(t for t, _ in totals.values())
    print(
        f"device busy {busy / steps / 1e3:.3f} ms/step in {sum(n for _, n in totals.values()) / steps:.0f} kernels/step"
    )
    for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {t / steps / 1e3:8.3f} ms {n / steps:6.1f}x  {name}")


def gap_summary(prof, steps: int) -> None:
    """Device idle time inside the profiled window, by the kernel that ran before each gap: where the device
    waits on the host (launches, copies) rather than on its own work."""
    spans = sorted(
        (ev.time_range.start, ev.time_range.end, ev.name[:60])
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    )
    if not spans:
        return
    gaps: dict[str, list[float]] = {}
    end, prev = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            g = gaps.setdefault(prev, [0.0, 0])
            g[0] += start - end
            g[1] += 1
        if stop > end:
            end, prev = stop, name
    idle = sum(g for g, _ in gaps.values())
    window = end - spans[0][0]
    print(f"device window {window / steps / 1e3:.3f} ms/step, idle {idle / steps / 1e3:.3f} ms/step; idle after:")
    for name, (g, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"  {g / steps / 1e3:8.3f} ms {n / steps:6.1f}x  {name}")
