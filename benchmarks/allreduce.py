"""All-reduce on one host: NCCL against the symmetric-memory one-shot and two-shot kernels of
comm/custom_all_reduce.py, each timed eagerly and inside a CUDA graph of back-to-back calls (as decode runs them: no
launch overhead).

    torchrun --nproc-per-node 2 -m benchmarks.allreduce            # table on rank 0, then one JSON line
    torchrun --nproc-per-node 2 -m benchmarks.allreduce --check    # correctness only; exit 0 if all correct
    torchrun --nproc-per-node 2 -m benchmarks.allreduce --fused-norm   # all-reduce + add + RMSNorm: fused vs not

Every result is checked against NCCL's sum of the ranks' random tensors and against the float64 truth. The
benchmark's `auto` column is comm.parallel.all_reduce with its real thresholds (ONE_SHOT_MAX_BYTES,
TWO_SHOT_MAX_BYTES); the JSON line suggests thresholds from the graph timings. If symmetric memory cannot be set
up, it says why and times NCCL alone. NANOSERVE_SYMM_MEM=0 forces that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from benchmarks.allreduce_fused_norm import fused_norm
from benchmarks.allreduce_inputs import KB, MB, close, max_over_ranks, rank_input, time_graph, truth
from benchmarks.gpu import require_cuda
from comm import custom_all_reduce, parallel

BENCH_SIZES = [8 * KB, 64 * KB, 256 * KB, 512 * KB, 1 * MB, 2 * MB, 8 * MB, 32 * MB, 64 * MB]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def fmt_size(n: int) -> str:
    return f"{n // MB}M" if n >= MB and n % MB == 0 else f"{n // KB}K" if n % KB == 0 else f"{n}B"


def fused_copy_available() -> bool:
    """Whether this torch has symm_mem's one-shot all-reduce with the copy-in inside the kernel (SymmAllReduce's
    one_shot takes it where it exists)."""
    try:
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out.default is not None
    except (AttributeError, RuntimeError):
        return False


def methods(symm) -> dict:
    """name -> in-place all-reduce of a flat CUDA tensor (returns the result)."""
    m = {"nccl": lambda x: (dist.all_reduce(x), x)[1]}
    if symm is not None:
        m["1shot"] = lambda x: symm.one_shot(x, fused=False)
        if fused_copy_available():
            m["1shot_fused"] = lambda x: symm.one_shot(x, fused=True)
        m["2shot"] = symm.two_shot
    m["auto"] = parallel.all_reduce
    return m


def check_eager(fn, numel, dtype, device, rank, world) -> dict:
    x = rank_input(rank, numel, dtype, device)
    ref = x.clone()
    dist.all_reduce(ref)
    got = fn(x.clone())
    torch.cuda.synchronize(device)
    return {"exact": bool(torch.equal(got, ref)), "ok": close(got, truth(world, numel, dtype, device), dtype, world)}


def check_graph(fn, numel, dtype, device, rank, world, replays: int = 3) -> dict:
    """Capture copy-in + all-reduce once, replay it on fresh inputs: each replay must give that input's sum."""
    src = torch.empty(numel, dtype=dtype, device=device)
    buf = torch.empty_like(src)
    src.copy_(rank_input(rank, numel, dtype, device))
    buf.copy_(src)
    fn(buf)  # eager warm-up before capture
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        buf.copy_(src)
        out = fn(buf)
    ok, exact = True, True
    for k in range(replays):
        src.copy_(rank_input(rank, numel, dtype, device, salt=k + 1))
        g.replay()
        torch.cuda.synchronize(device)
        ref = rank_input(rank, numel, dtype, device, salt=k + 1)
        dist.all_reduce(ref)
        exact &= bool(torch.equal(out, ref))
        ok &= close(out, truth(world, numel, dtype, device, salt=k + 1), dtype, world)
    del g
    return {"exact": exact, "ok": ok}


def time_eager(fn, numel, dtype, device, iters: int) -> float:
    z = torch.zeros(numel, dtype=dtype, device=device)  # zeros: repeated in-place sums stay finite
    for _ in range(5):
        fn(z)
    torch.cuda.synchronize(device)
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(z)
    end.record()
    end.synchronize()
    return max_over_ranks(start.elapsed_time(end) * 1000 / iters, device)


def suggest(rows: list[dict]) -> dict:
    """Thresholds from the graph timings: one-shot while it beats two-shot (and NCCL), symmetric memory while it
    beats NCCL, each over the run of sizes that starts at the smallest."""
    one_max, two_max, one_run = 0, 0, True
    for row in rows:
        t = {k: v["graph_us"] for k, v in row["methods"].items() if "graph_us" in v}
        one = min((t[k] for k in ("1shot", "1shot_fused") if k in t), default=None)
        if one is None or "2shot" not in t or "nccl" not in t or min(one, t["2shot"]) >= t["nccl"]:
            break
        two_max = row["bytes"]
        one_run &= one <= t["2shot"]
        one_max = row["bytes"] if one_run else one_max
    return {"one_shot_max": one_max, "two_shot_max": two_max}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--check", action="store_true", help="correctness only (exit 1 on any mismatch or no symm)")
    p.add_argument("--fused-norm", action="store_true", help="check and time the fused all-reduce + add + RMSNorm")
    p.add_argument("--hidden", type=int, default=4096, help="--fused-norm: row width")
    p.add_argument("--sweep", action="store_true", help="--fused-norm: time every launch configuration too")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="tensor dtype (default bfloat16)")
    p.add_argument("--sizes", default="", help="comma-separated byte sizes, e.g. 8K,1M (default: the usual set)")
    p.add_argument("--graph-calls", type=int, default=20, help="all-reduces per captured graph")
    p.add_argument("--replays", type=int, default=20, help="graph replays timed per size")
    p.add_argument("--iters", type=int, default=200, help="eager calls timed per size")
    a = p.parse_args()
    require_cuda(2)
    if "RANK" not in os.environ:
        sys.exit("benchmarks.allreduce runs one process per GPU: torchrun --nproc-per-node 2 -m benchmarks.allreduce")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    dtype = DTYPES[a.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    parallel.set_tp(rank, world)
    if a.fused_norm:
        code = fused_norm(a, rank, world, device, dtype)
    elif a.check:
        code = check(a, rank, world, device, dtype, itemsize)
    else:
        code = bench(a, rank, world, device, dtype, itemsize)
    dist.barrier()
    dist.destroy_process_group()
    return code


def parse_sizes(text: str) -> list[int]:
    out = []
    for tok in filter(None, (t.strip() for t in text.split(","))):
        mult = {"K": KB, "M": MB}.get(tok[-1].upper(), 1)
        out.append(int(tok[:-1] if mult > 1 else tok) * mult)
    return out


def bench(a, rank, world, device, dtype, itemsize) -> int:
    sizes = parse_sizes(a.sizes) or BENCH_SIZES
    # a buffer as large as the largest size, so one-/two-shot can be timed everywhere; `auto` keeps the real cut-offs
    on = custom_all_reduce.init_custom_all_reduce(max(sizes), dtype, device, two_shot_max=max(sizes))
    symm = custom_all_reduce.get_symm_all_reduce()
    if symm is not None:
        symm.two_shot_max = custom_all_reduce.TWO_SHOT_MAX_BYTES
    reason = None if on else "symmetric memory off (see the stderr line above)"
    fns = methods(symm)
    rows, all_ok = [], True
    for nbytes in sizes:
        numel = nbytes // itemsize
        row = {"bytes": nbytes, "methods": {}}
        for name, fn in fns.items():
            try:
                res = check_eager(fn, numel, dtype, device, rank, world)
                g = check_graph(fn, numel, dtype, device, rank, world, replays=2)
                res = {"ok": res["ok"] and g["ok"], "exact_vs_nccl": res["exact"] and g["exact"]}
                iters = max(20, min(a.iters, int(a.iters * 2 * MB / max(nbytes, 1))))
                res["eager_us"] = time_eager(fn, numel, dtype, device, iters)
                res["graph_us"] = time_graph(fn, numel, dtype, device, a.graph_calls, a.replays)
                res["busbw_gbs"] = nbytes / (res["graph_us"] * 1e-6) * 2 * (world - 1) / world / 1e9
            except Exception as e:  # a symm method that fails here must not hide the NCCL numbers
                res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
            all_ok &= res["ok"]
            row["methods"][name] = res
        if symm is not None:
            row["auto_path"] = symm.method_for(torch.empty(numel, dtype=dtype, device=device))
        rows.append(row)
    if rank == 0:
        names = list(fns)
        print(f"\nall-reduce {a.dtype}, {world} ranks; us per call: graph of {a.graph_calls} | eager;", end=" ")
        print("busbw GB/s of the fastest (graph)")
        print(f"{'size':>6s} " + " ".join(f"{n:>15s}" for n in names) + f" {'fastest':>12s} {'GB/s':>6s}  auto")
        for row in rows:
            cells = []
            for n in names:
                r = row["methods"][n]
                cell = f"{r['graph_us']:.1f}|{r['eager_us']:.1f}" if "graph_us" in r else "error"
                cells.append(f"{cell + ('' if r['ok'] else '!'):>15s}")
            timed = {n: r for n, r in row["methods"].items() if "graph_us" in r and n != "auto"}
            best = min(timed, key=lambda n: timed[n]["graph_us"]) if timed else "-"
            bw = f"{timed[best]['busbw_gbs']:6.1f}" if timed else "     -"
            print(
                f"{fmt_size(row['bytes']):>6s} " + " ".join(cells) + f" {best:>12s} {bw}  {row.get('auto_path', '-')}"
            )
        print("('!' = wrong result)")
        for row in rows:
            for n, r in row["methods"].items():
                if "error" in r:
                    print(f"{fmt_size(row['bytes'])} {n}: {r['error']}")
        summary = {
            "bench": "allreduce",
            "world": world,
            "dtype": a.dtype,
            "torch": torch.__version__,
            "symm": on,
            "symm_reason": reason,
            "fused_one_shot": symm is not None and fused_copy_available(),
            "thresholds": {
                "one_shot_max": custom_all_reduce.ONE_SHOT_MAX_BYTES,
                "two_shot_max": custom_all_reduce.TWO_SHOT_MAX_BYTES,
            },
            "suggested": suggest(rows) if symm is not None else None,
            "ok": all_ok,
            "rows": rows,
        }
        print(json.dumps(summary), flush=True)
    return 0 if all_ok else 1


def check(a, rank, world, device, dtype, itemsize) -> int:
    """comm.parallel.all_reduce (real thresholds and buffer cap) and each forced kernel against NCCL, eagerly and
    under CUDA graph capture/replay, including one graph that mixes paths as a forward pass does."""
    sizes = parse_sizes(a.sizes) or [4 * KB, 8 * KB, 96 * KB, 512 * KB, 512 * KB + 16, 2 * MB, 6 * MB, 32 * MB]
    on = custom_all_reduce.init_custom_all_reduce(max(sizes), dtype, device)
    symm = custom_all_reduce.get_symm_all_reduce()
    results, ok = [], on
    fns = methods(symm)
    cases = [(n // itemsize, dtype) for n in sizes] + [(4097, dtype), (1, dtype), (3 * 4096, torch.float16)]
    for numel, dt in cases:
        for name, fn in fns.items():
            if name != "auto" and name != "nccl" and (dt != dtype or not symm.fits(torch.empty(numel, dtype=dt))):
                continue  # forced kernels only where the buffer takes the tensor
            try:
                e = check_eager(fn, numel, dt, device, rank, world)
                g = check_graph(fn, numel, dt, device, rank, world)
                res = {"ok": e["ok"] and g["ok"], "exact": e["exact"] and g["exact"]}
            except Exception as ex:
                res = {"ok": False, "error": f"{type(ex).__name__}: {ex}"[:300]}
            path = symm.method_for(torch.empty(numel, dtype=dt, device=device)) if symm and name == "auto" else None
            results.append({"numel": numel, "dtype": str(dt), "method": name, "path": path, **res})
            ok &= res["ok"]
    ok &= check_mixed_graph(symm, dtype, device, rank, world, results) if symm is not None else False
    if rank == 0:
        for r in results:
            if not r["ok"]:
                print("FAIL", r)
        print(json.dumps({"check": "allreduce", "world": world, "symm": on, "ok": bool(ok), "results": results}))
    return 0 if ok else 1


def check_mixed_graph(symm, dtype, device, rank, world, results) -> bool:
    """One graph with all_reduce at several sizes in a row (one-shot, two-shot, NCCL), replayed on fresh inputs."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numels = [8 * KB // itemsize, 1 * MB // itemsize, 64 * KB // itemsize, symm.two_shot_max // itemsize * 2, 1024]
    srcs = [torch.empty(n, dtype=dtype, device=device) for n in numels]
    bufs = [torch.empty_like(s) for s in srcs]
    for s, b in zip(srcs, bufs):
        s.copy_(rank_input(rank, s.numel(), dtype, device))
        b.copy_(s)
        parallel.all_reduce(b)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = []
        for s, b in zip(srcs, bufs):
            b.copy_(s)
            outs.append(parallel.all_reduce(b))
    ok = True
    for k in range(4):
        for s in srcs:
            s.copy_(rank_input(rank, s.numel(), dtype, device, salt=10 + k))
        g.replay()
        torch.cuda.synchronize(device)
        for s, o in zip(srcs, outs):
            ok &= close(o, truth(world, s.numel(), dtype, device, salt=10 + k), dtype, world)
    paths = [symm.method_for(b) for b in bufs]
    results.append({"method": "mixed_graph", "paths": paths, "ok": ok})
    return ok


if __name__ == "__main__":
    sys.exit(main())
