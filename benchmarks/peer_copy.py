"""Can the copy engines move a rank's partial sums to its peer while the SMs multiply? (docs/PERF.md log 12j)

    torchrun --nproc-per-node 2 benchmarks/peer_copy.py

Times, on two GPUs of one host: a copy of this rank's tensor into the peer's symmetric buffer (``copy_`` into a
peer-mapped view: a cudaMemcpyAsync the driver routes over NVLink), a prefill-sized GEMM alone, and both at once on
two streams; checks that the peer's bytes arrived; lists the profiler's names for the copy (a "Memcpy" runs on a
copy engine, a kernel on the SMs). Rank 0 prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

MB = 1 << 20


def time_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed._symmetric_memory as symm_mem

    numel = 64 * MB // 2
    buf = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = (rank + 1) % world
    local = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream(device=device)
    rows: dict[str, float] = {}
    for size in (2 * MB, 32 * MB, 64 * MB):
        view = handle.get_buffer(peer, (size // 2,), torch.bfloat16)
        rows[f"copy {size // MB} MiB to the peer"] = time_us(lambda v=view, n=size // 2: v.copy_(local[:n]))
    torch.cuda.synchronize()
    dist.barrier()
    arrived = bool((buf == float(peer + 1)).all())  # the peer copied its value (peer + 1) into our buffer

    a = torch.randn(8192, 4096, dtype=torch.bfloat16, device=device)
    w = torch.randn(12288, 4096, dtype=torch.bfloat16, device=device)
    rows["gemm 8192 x 4096 x 12288"] = time_us(lambda: torch.mm(a, w.t()))
    view = handle.get_buffer(peer, (16 * MB,), torch.bfloat16)  # 32 MiB: half of an 8,192-token all-reduce

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            view.copy_(local[: 16 * MB])
        torch.mm(a, w.t())
        torch.cuda.current_stream().wait_stream(side)

    rows["gemm + 32 MiB copy on a side stream"] = time_us(both)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        view.copy_(local[: 16 * MB])
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    if rank == 0:
        for name, us in rows.items():
            print(f"{name:40s} {us:9.1f} us")
        print("copy runs as:", names, "| peer bytes arrived:", arrived)
        print(json.dumps({"bench": "peer_copy", "us": rows, "copy_events": names, "arrived": arrived}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
