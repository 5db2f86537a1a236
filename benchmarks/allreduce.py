"""All-reduce on one host: NCCL against the symmetric-memory one-shot and two-shot kernels of
model/custom_all_reduce.py, each timed eagerly and inside a CUDA graph of back-to-back calls (as decode runs them: no
launch overhead).

    torchrun --nproc-per-node 2 -m benchmarks.allreduce            # table on rank 0, then one JSON line
    torchrun --nproc-per-node 2 -m benchmarks.allreduce --check    # correctness only; exit 0 if all correct
    torchrun --nproc-per-node 2 -m benchmarks.allreduce --fused-norm   # all-reduce + add + RMSNorm: fused vs not

Every result is checked against NCCL's sum of the ranks' random tensors and against the float64 truth. The
benchmark's `auto` column is model.parallel.all_reduce with its real thresholds (ONE_SHOT_MAX_BYTES,
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

from benchmarks.gpu import require_cuda
from benchmarks.timing import replay_ms
from model import custom_all_reduce, parallel

KB, MB = 1024, 1024 * 1024
BENCH_SIZES = [8 * KB, 64 * KB, 256 * KB, 512 * KB, 1 * MB, 2 * MB, 8 * MB, 32 * MB, 64 * MB]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def fmt_size(n: int) -> str:
    return f"{n // MB}M" if n >= MB and n % MB == 0 else f"{n // KB}K" if n % KB == 0 else f"{n}B"


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


def methods(symm) -> dict:
    """name -> in-place all-reduce of a flat CUDA tensor (returns the result)."""
    m = {"nccl": lambda x: (dist.all_reduce(x), x)[1]}
    if symm is not None:
        m["1shot"] = lambda x: symm.one_shot(x, fused=False)
        if symm._one_copy is not None:
            m["1shot_fused"] = lambda x: symm.one_shot(x, fused=True)
        m["2shot"] = symm.two_shot
    m["auto"] = parallel.all_reduce
    return m


def max_over_ranks(v: float, device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


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


def time_graph(fn, numel, dtype, device, calls: int, replays: int) -> float:
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
            "fused_one_shot": symm is not None and symm._one_copy is not None,
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
    """model.parallel.all_reduce (real thresholds and buffer cap) and each forced kernel against NCCL, eagerly and
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


def fused_norm(a, rank, world, device, dtype) -> int:
    """kernels/allreduce_norm.py against all_reduce + fused.rmsnorm (what runs without it): the same results
    (eager, and replayed in a graph of chained calls that alternates the buffer halves), then us per call in graphs
    of back-to-back calls, as a decode step runs them. Rows are tokens of width --hidden."""
    from kernels import fused

    hidden = a.hidden
    rows_list = [int(r) for r in a.sizes.split(",")] if a.sizes else [1, 8, 64, 256, 1024, 2048, 8192]
    itemsize = torch.empty((), dtype=dtype).element_size()
    max_bytes = max(rows_list) * hidden * itemsize
    custom_all_reduce.init_custom_all_reduce(max_bytes, dtype, device)
    if max_bytes > custom_all_reduce.FUSED_MAX_BYTES:  # a buffer as large as the largest size timed here
        custom_all_reduce._init_fused(max_bytes, dtype, device, dist.group.WORLD)
    fz = custom_all_reduce.get_fused_all_reduce_norm()
    if fz is None:
        print(json.dumps({"bench": "fused_norm", "ok": False, "error": "fused all-reduce unavailable"}))
        return 1
    weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))).to(dtype).to(device)
    eps = 1e-6

    def unfused(x, residual):
        return fused.rmsnorm(parallel.all_reduce(x.clone()), weight, eps, residual)

    def inputs(rows, salt):
        x = rank_input(rank, rows * hidden, dtype, device, salt).view(rows, hidden)
        res = rank_input(world + 1, rows * hidden, dtype, device, salt).view(rows, hidden)  # the same on all ranks
        return x, res

    results, ok = [], True
    for rows in rows_list:
        x, res = inputs(rows, 0)
        want_out, want_res = unfused(x, res)
        got_out, got_res = fz(x, res, weight, eps)
        no_res = fz(x, None, weight, eps)
        torch.cuda.synchronize(device)
        r = {
            "rows": rows,
            "res_exact": bool(torch.equal(got_res, want_res)),
            "out_err": float((got_out.float() - want_out.float()).abs().max()),
            "no_residual_err": float(
                (no_res.float() - fused.rmsnorm(parallel.all_reduce(x.clone()), weight, eps).float()).abs().max()
            ),
        }
        # a graph of three chained calls (halves A, B, A), replayed on fresh inputs
        sx, sres = x.clone(), res.clone()
        with torch.cuda.graph(g := torch.cuda.CUDAGraph()):
            o1, r1 = fz(sx, sres, weight, eps)
            o2, r2 = fz(o1, r1, weight, eps)
            o3, r3 = fz(o2, r2, weight, eps)
        graph_ok = True
        for k in range(3):
            nx, nres = inputs(rows, k + 1)
            sx.copy_(nx), sres.copy_(nres)
            g.replay()
            e1, f1 = unfused(nx, nres)
            e2, f2 = unfused(e1, f1)
            e3, f3 = unfused(e2, f2)
            torch.cuda.synchronize(device)
            graph_ok &= torch.equal(r3, f3) and float((o3.float() - e3.float()).abs().max()) <= 0.02
        del g
        r["graph_ok"] = bool(graph_ok)
        r["ok"] = r["res_exact"] and r["out_err"] <= 0.02 and r["no_residual_err"] <= 0.02 and r["graph_ok"]
        ok &= r["ok"]
        z, zr = (
            torch.zeros(rows, hidden, dtype=dtype, device=device),
            torch.zeros(rows, hidden, dtype=dtype, device=device),
        )
        r["fused_us"] = time_graph(
            lambda _, z=z, zr=zr: fz(z, zr, weight, eps), 1, dtype, device, a.graph_calls, a.replays
        )
        r["unfused_us"] = time_graph(
            lambda _, z=z, zr=zr: fused.rmsnorm(parallel.all_reduce(z), weight, eps, zr),
            1,
            dtype,
            device,
            a.graph_calls,
            a.replays,
        )
        r["unfused_path"] = custom_all_reduce.get_symm_all_reduce().method_for(z.view(-1))
        r["in_place_us"] = time_graph(  # the projection wrote into the buffer half: no copy-in
            lambda _, zr=zr, rows=rows: fz(fz.next_input(rows, hidden, dtype), zr, weight, eps),
            1,
            dtype,
            device,
            a.graph_calls,
            a.replays,
        )
        if a.sweep:
            r["sweep"] = sweep_fused(a, fz, z, zr, weight, eps, dtype, device)
        results.append(r)
    if rank == 0:
        print(f"\nall-reduce + add + RMSNorm, {world} ranks, width {hidden}; us per call in graphs")
        print(f"{'rows':>6s} {'MiB':>6s} {'unfused':>9s} {'fused':>9s} {'in place':>9s} {'ratio':>6s}  ok  (unfused)")
        for r in results:
            mib = r["rows"] * hidden * itemsize / MB
            print(
                f"{r['rows']:6d} {mib:6.2f} {r['unfused_us']:9.1f} {r['fused_us']:9.1f} {r['in_place_us']:9.1f}"
                f" {r['unfused_us'] / r['in_place_us']:6.2f}  {'yes' if r['ok'] else 'NO'}  ({r['unfused_path']})"
            )
            if "sweep" in r:
                best = sorted(r["sweep"].items(), key=lambda kv: kv[1])[:4]
                print(
                    "        best (programs, rows/tile, warps, copy-in): " + ", ".join(f"{k} {v:.1f}" for k, v in best)
                )
        print(json.dumps({"bench": "fused_norm", "world": world, "hidden": hidden, "ok": bool(ok), "rows": results}))
    return 0 if ok else 1


def sweep_fused(a, fz, z, zr, weight, eps, dtype, device) -> dict:
    """us per call of the fused kernel's launch configurations (programs, rows per tile, warps, copy-in)."""
    from kernels.allreduce_norm import allreduce_add_rmsnorm

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = {}
    for programs in sorted({sms, fz.max_programs}):
        for rows_per_tile in (1, 2, 4):
            for warps in (4, 8, 16):
                for copy_in in (True, False):

                    def call(_, p=programs, rpt=rows_per_tile, w=warps, c=copy_in):
                        offset = (fz.calls % 2) * fz.half_numel
                        fz.calls += 1
                        return allreduce_add_rmsnorm(
                            z, zr, weight, eps, fz.buf_ptrs, fz.pad_ptrs, offset, fz.rank, fz.world_size, p, c, rpt, w
                        )

                    key = f"({programs},{rows_per_tile},{warps},{int(copy_in)})"
                    out[key] = time_graph(call, 1, dtype, device, a.graph_calls, a.replays)
    return out


if __name__ == "__main__":
    sys.exit(main())
