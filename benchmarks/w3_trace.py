"""W3 with prefix caching on the GPU, one engine, with each step's device and host times: where does a run's time
go, step by step, and what differs between two trees? (benchmarks/w3_bisect.sh runs it on two trees.)

    NANOSERVE_STEP_TRACE=trace.json python -m benchmarks.w3_trace --out run.json [--rounds 3]
    python -m benchmarks.w3_trace --compare base_run.json base_trace.json new_run.json new_trace.json

A run: W3's requests (benchmarks/workloads.w3_requests; ``fresh``-shifted ids in rounds after the first, so no
round hits another's cache) as benchmarks/throughput.py's W3 runs them with caching on (--shape qwen3-0.6b, dummy
weights, max_model_len 4096, a 16-token warm-up first). The coordinator's host side is timed per ``Engine.step``:
its wall time and the part of it spent waiting for a worker's result (recv_result); the rest is host work that
the device may wait for. The worker's step trace (worker/step_trace.py, rank 0, written at shutdown) gives each
step's device busy time, the device idle gap before it, the worker's host launch time and any Triton compile.
Runs on older trees too (``client.llm`` before ``nanoserve.llm``). The compare prints one table per round part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _llm_class():
    try:
        from nanoserve.llm import LLM
    except ImportError:  # before the folders were named for their process (c6ee00b)
        from client.llm import LLM
    return LLM


def run(out: str, rounds: int, device: str = "cuda", shape: str = "qwen3-0.6b", scale: int = 1) -> None:
    from benchmarks.shapes import write_shape
    from benchmarks.workloads import fresh, w3_requests, warmup_prompt
    from protocol.sampling_params import SamplingParams

    reqs = w3_requests(scale, None, prefix_cached=True)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=r.max_tokens) for r in reqs]
    out_tokens = sum(r.max_tokens for r in reqs)
    kw = dict(device=device, load_format="dummy", max_model_len=4096, enable_prefix_caching=True)
    res: dict = {"rounds": []}
    with _llm_class()(str(write_shape(shape)), **kw) as llm:
        eng = llm.engine
        llm.generate(warmup_prompt(), SamplingParams(max_tokens=16), use_tqdm=False)
        steps: list[tuple[float, float]] = []  # per Engine.step: (wall ms, ms waiting for a result)
        waited = [0.0]
        recv, step = eng.workers.recv_result, eng.step

        def timed_recv(step_id):
            t0 = time.perf_counter()
            try:
                return recv(step_id)
            finally:
                waited[0] += time.perf_counter() - t0

        def timed_step():
            waited[0] = 0.0
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                steps.append(((time.perf_counter() - t0) * 1e3, waited[0] * 1e3))

        eng.workers.recv_result, eng.step = timed_recv, timed_step
        for r in range(rounds):
            prompts = [fresh(q.prompt, r) if r else q.prompt for q in reqs]
            first, n0 = eng.stats()["steps"], len(steps)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            host = [w - wait for w, wait in steps[n0:]]
            res["rounds"].append(
                {
                    "tok_s": out_tokens / seconds,
                    "seconds": seconds,
                    "first_step": first,
                    "end_step": eng.stats()["steps"],
                    "engine_steps": len(host),
                    "coordinator_host_ms": sum(host),
                    "coordinator_host_ms_top5": sorted(host, reverse=True)[:5],
                }
            )
            print(f"round {r}: {out_tokens / seconds:,.0f} tok/s ({seconds * 1e3:.1f} ms)", flush=True)
    with open(out, "w") as f:
        json.dump(res, f)


def _parts(run_res: dict, trace: list[dict]) -> dict[str, list[dict]]:
    """The trace rows of round 0 and of later rounds, by kind (prefill steps, decode-only steps)."""
    out: dict[str, list[dict]] = {}
    for i, rnd in enumerate(run_res["rounds"]):
        rows = trace[rnd["first_step"] : rnd["end_step"]]
        tag = "round0" if i == 0 else "later"
        out.setdefault(f"{tag} prefill", []).extend(r for r in rows if r["tokens"] > r["seqs"])
        out.setdefault(f"{tag} decode", []).extend(r for r in rows if r["tokens"] == r["seqs"])
    return out


def compare(base_run: str, base_trace: str, new_run: str, new_trace: str) -> None:
    sides = []
    for run_file, trace_file in ((base_run, base_trace), (new_run, new_trace)):
        res = json.load(open(run_file))
        trace = json.load(open(trace_file)) if os.path.exists(trace_file) else []  # none written: a CPU run
        sides.append((res, trace, _parts(res, trace)))
    print(f"{'':34s}{'base':>12s}{'new':>12s}{'new-base':>10s}")

    def line(name: str, a: float, b: float, fmt: str = ".2f") -> None:
        print(f"{name:34s}{a:12{fmt}}{b:12{fmt}}{b - a:10{fmt}}")

    (ra, ta, pa), (rb, tb, pb) = sides
    line("round 0 tok/s", ra["rounds"][0]["tok_s"], rb["rounds"][0]["tok_s"], ",.0f")
    line("median tok/s", *(statistics.median(r["tok_s"] for r in s[0]["rounds"]) for s in sides), ",.0f")
    line("round 0 ms", ra["rounds"][0]["seconds"] * 1e3, rb["rounds"][0]["seconds"] * 1e3, ".1f")
    line("round 0 steps", ra["rounds"][0]["engine_steps"], rb["rounds"][0]["engine_steps"], ".0f")
    line("round 0 coordinator host ms", ra["rounds"][0]["coordinator_host_ms"], rb["rounds"][0]["coordinator_host_ms"])
    for part in pa:
        a, b = pa[part], pb.get(part, [])
        line(f"{part}: steps", len(a), len(b), ".0f")
        for key in ("busy_ms", "gap_ms", "launch_ms", "wait_ms"):
            line(f"{part}: {key} sum", sum(r.get(key, 0.0) for r in a), sum(r.get(key, 0.0) for r in b))
    # round 0 step by step: the steps whose device busy or idle time moved most
    a0 = ta[ra["rounds"][0]["first_step"] : ra["rounds"][0]["end_step"]]
    b0 = tb[rb["rounds"][0]["first_step"] : rb["rounds"][0]["end_step"]]
    moved = sorted(
        range(min(len(a0), len(b0))),
        key=lambda i: -abs(b0[i]["busy_ms"] + b0[i]["gap_ms"] - a0[i]["busy_ms"] - a0[i]["gap_ms"]),
    )[:8]
    print("round 0, the steps that moved most (seqs/tokens, busy base->new, gap base->new, launch base->new ms):")
    for i in sorted(moved):
        x, y = a0[i], b0[i]
        print(
            f"  step {i:4d} {x['seqs']:4d}/{x['tokens']:5d}  busy {x['busy_ms']:7.2f} -> {y['busy_ms']:7.2f}  "
            f"gap {x['gap_ms']:6.2f} -> {y['gap_ms']:6.2f}  launch {x['launch_ms']:6.2f} -> {y['launch_ms']:6.2f}"
        )
    for name, trace in (("base", ta), ("new", tb)):
        compiled = [(i, r["compiled"]) for i, r in enumerate(trace) if r.get("compiled")]
        print(f"{name}: Triton compiles during the run: {compiled or 'none'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", help="this run's JSON (rounds, step ranges, coordinator host times)")
    p.add_argument("--rounds", type=int, default=3, help="W3 rounds in one engine (each with fresh ids)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no step trace)")
    p.add_argument("--shape", default="qwen3-0.6b", help="benchmarks/shapes.py (tiny for a CPU smoke run)")
    p.add_argument("--scale", type=int, default=1, help="W3's lengths divided by this (smoke runs only)")
    p.add_argument(
        "--compare",
        nargs=4,
        metavar=("BASE_RUN", "BASE_TRACE", "NEW_RUN", "NEW_TRACE"),
        help="print the table of two runs (their --out JSON and step traces) instead of running",
    )
    args = p.parse_args(argv)
    if args.compare:
        compare(*args.compare)
    elif args.out:
        run(args.out, args.rounds, args.device, args.shape, args.scale)
    else:
        p.error("--out or --compare")


if __name__ == "__main__":
    main()
