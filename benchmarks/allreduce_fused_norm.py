"""The fused all-reduce + add + RMSNorm of kernels/allreduce_norm.py against all_reduce + fused.rmsnorm, checked and
timed in CUDA graphs; run through benchmarks/allreduce.py:

    torchrun --nproc-per-node 2 -m benchmarks.allreduce --fused-norm [--hidden 4096] [--sweep]
"""

from __future__ import annotations

import json

import torch

from benchmarks.allreduce_inputs import MB, rank_input, time_graph
from comm import custom_all_reduce, parallel


def fused_norm(a, rank, world, device, dtype) -> int:
    """kernels/allreduce_norm.py against all_reduce + fused.rmsnorm (what runs without it): the same results
    (eager, and replayed in a graph of chained calls that alternates the buffer halves), then us per call in graphs
    of back-to-back calls, as a decode step runs them. Rows are tokens of width --hidden."""
    from kernels import fused

    hidden = a.hidden
    rows_list = [int(r) for r in a.sizes.split(",")] if a.sizes else [1, 8, 64, 256, 1024, 2048, 8192]
    itemsize = torch.empty((), dtype=dtype).element_size()
    # the engine's fused buffer holds FUSED_MAX_BYTES a call; larger calls run unfused there, so they are not timed
    over = [r for r in rows_list if r * hidden * itemsize > custom_all_reduce.FUSED_MAX_BYTES]
    rows_list = [r for r in rows_list if r not in over]
    if over and rank == 0:
        print(f"rows {over}: over the fused buffer ({custom_all_reduce.FUSED_MAX_BYTES >> 20} MiB a call), not timed")
    if not rows_list:
        return 1
    max_bytes = max(rows_list) * hidden * itemsize
    custom_all_reduce.init_custom_all_reduce(max_bytes, dtype, device)
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
