"""Per-step device timing, on when NANOSERVE_STEP_TRACE names a file (rank 0, CUDA only).

For every step: the device time from its first kernel to its last (busy), and the device idle time between the
previous step's end and this step's start (gap): the gap is what async scheduling exists to remove. On the host:
how long the worker waited for the step's command after launching the previous one (wait), how long
launching it took (launch), which Triton kernels it compiled and whether the caching allocator grew. Events are
read back only at shutdown, so tracing adds no synchronization to the step loop.

    python -m worker.step_trace FILE     # summary of a trace, decode steps by batch size, the longest gaps
"""

from __future__ import annotations

import json
import sys
import time

import torch


class StepTrace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.records: list[tuple] = []
        self.prev_end: torch.cuda.Event | None = None
        self.prev_launched = 0.0  # host clock when the previous step's launch returned
        self.compiled: list[str] = []  # Triton kernels compiled (cache misses), in order
        self._hook_compiles()

    def _hook_compiles(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # an older Triton: no compile records
            return
        chained = knobs.runtime.jit_cache_hook

        def on_cache_miss(*args, **kwargs):
            self.compiled.append(getattr(kwargs.get("fn"), "name", "?"))
            return chained(*args, **kwargs) if chained else False  # False: compile as usual

        knobs.runtime.jit_cache_hook = on_cache_miss

    def begin(self, received: float) -> tuple[torch.cuda.Event, float, int]:
        """``received``: the host clock when the step's command arrived."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start, received, len(self.compiled)

    def end(self, begun: tuple[torch.cuda.Event, float, int], num_seqs: int, num_tokens: int) -> None:
        start, received, num_compiled = begun
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        now = time.perf_counter()
        wait = (received - self.prev_launched) * 1e3 if self.prev_launched else 0.0
        reserved = torch.cuda.memory_reserved() / 2**20  # grows when the step needed a new cudaMalloc
        compiled = self.compiled[num_compiled:]
        self.records.append(
            (num_seqs, num_tokens, start, end, self.prev_end, wait, (now - received) * 1e3, compiled, reserved)
        )
        self.prev_end, self.prev_launched = end, now

    def dump(self) -> None:
        torch.cuda.synchronize()
        rows = []
        for num_seqs, num_tokens, start, end, prev, wait, launch, compiled, reserved in self.records:
            gap = prev.elapsed_time(start) if prev is not None else 0.0
            busy = start.elapsed_time(end)
            rows.append(
                {
                    "seqs": num_seqs,
                    "tokens": num_tokens,
                    "busy_ms": busy,
                    "gap_ms": gap,
                    "wait_ms": wait,
                    "launch_ms": launch,
                    "compiled": compiled,
                    "reserved_mib": reserved,
                }
            )
        with open(self.path, "w") as f:
            json.dump(rows, f)
        # device allocations and frees (cudaFree synchronizes) and out-of-memory retries over the whole run
        stats = torch.cuda.memory_stats()
        keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
        print("nanoserve[step trace]: allocator", {k: stats.get(k) for k in keys}, file=sys.stderr, flush=True)


def summarize(rows: list[dict]) -> str:
    """Busy and idle device time, split into decode-only steps and steps with prefill tokens."""
    out = []
    for name, sel in (
        ("decode-only", lambda r: r["tokens"] == r["seqs"]),
        ("with prefill", lambda r: r["tokens"] > r["seqs"]),
    ):
        part = [r for r in rows if sel(r)]
        if not part:
            continue
        busy = sum(r["busy_ms"] for r in part)
        gap = sum(r["gap_ms"] for r in part if r["gap_ms"] < 1000)  # longer: the pause after warm-up
        launch = sum(r.get("launch_ms", 0.0) for r in part)
        out.append(
            f"{name:13s} steps {len(part):5d}  busy {busy / 1e3:7.3f} s ({busy / len(part):6.3f} ms/step)  "
            f"idle before them {gap / 1e3:6.3f} s ({gap / len(part):6.3f} ms/step)  "
            f"host launch {launch / len(part):6.3f} ms/step"
        )
    return "\n".join(out)


def by_batch(rows: list[dict], width: int = 32) -> str:
    """Decode-only steps grouped by sequences per step (``width`` per row): count and mean busy ms per step."""
    groups: dict[int, list[float]] = {}
    for r in rows:
        if r["tokens"] == r["seqs"]:
            groups.setdefault((r["seqs"] - 1) // width, []).append(r["busy_ms"])
    out = [f"{'sequences':>11s} {'steps':>6s} {'ms/step':>8s} {'busy s':>7s}"]
    for g in sorted(groups):
        times = groups[g]
        span = f"{g * width + 1}-{(g + 1) * width}"
        out.append(f"{span:>11s} {len(times):6d} {sum(times) / len(times):8.3f} {sum(times) / 1e3:7.3f}")
    return "\n".join(out)


def longest_gaps(rows: list[dict], n: int = 8) -> str:
    """The ``n`` longest idle gaps before a step (warm-up pauses of a second or more left out), in step order."""
    gaps = sorted(((r["gap_ms"], i) for i, r in enumerate(rows) if r["gap_ms"] < 1000), reverse=True)[:n]
    return "\n".join(
        f"step {i:5d} ({rows[i]['seqs']} seqs, {rows[i]['tokens']} tokens): {g:.2f} ms idle before it; host waited"
        f" {rows[i].get('wait_ms', 0.0):.2f} ms for its command, launched it in {rows[i].get('launch_ms', 0.0):.2f} ms"
        for g, i in sorted(gaps, key=lambda x: x[1])
    )


def startup_costs(rows: list[dict]) -> str:
    """Steps that compiled Triton kernels or grew the caching allocator's reserve (a cudaMalloc)."""
    out, reserved = [], rows[0].get("reserved_mib", 0.0) if rows else 0.0
    for i, r in enumerate(rows):
        grew = r.get("reserved_mib", reserved) - reserved
        reserved = r.get("reserved_mib", reserved)
        if r.get("compiled") or grew > 0:
            out.append(
                f"step {i:5d} ({r['seqs']} seqs, {r['tokens']} tokens, busy {r['busy_ms']:.2f} ms): compiled "
                f"{r.get('compiled') or 'nothing'}, reserve +{grew:.0f} MiB"
            )
    return "\n".join(out) or "no step compiled a kernel or grew the allocator's reserve"


if __name__ == "__main__":
    trace = json.load(open(sys.argv[1]))
    print(summarize(trace), by_batch(trace), longest_gaps(trace), startup_costs(trace), sep="\n\n")
