"""End-to-end throughput of nanoserve on the workloads of WORKLOADS.md, against a roofline floor (and HF, optionally).

    python -m benchmarks.throughput --workload W1|W2|W3 (--model DIR | --shape NAME)   # NAME: benchmarks/shapes.py
        [--tp N] [--enforce-eager] [--num-prompts N] [--hf-num-prompts N] [--repeat N]
        [--device cuda|cpu] [--dtype bfloat16] [--max-num-seqs N] [--max-num-batched-tokens N] [--block-size N]
        [--gpu-memory-utilization F] [--num-kv-blocks N] [--scale S] [--hbm-tbs X] [--tflops X]
        [--quantization fp8] [--kv-cache-dtype fp8] [--compare hf|bf16] [--structured-outputs JSON]
    python -m benchmarks.throughput --check-floors     # W1/W2/W3 floors at the nominal H200 ceilings (CPU only)

Workloads (benchmarks/WORKLOADS.md):
  W1  nano-vllm's bench.py: random.seed(0); 256 prompts of randint(0, 10000) ids, lengths randint(100, 1024); then
      per prompt SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024)); max_model_len 4096;
      one small warm-up generate, then one timed generate of all. tok/s = sum(max_tokens) / seconds.
      --num-prompts N keeps the first N (all 256 are drawn first, so the first N are the same prompts).
      --repeat N times it N times in the same engine, round r with every id shifted by r + 1 (no round hits another's
      prefix cache; same lengths): tok_s stays the first round's, tok_s_rounds and tok_s_median are added. The
      runs of one code path spread ~1% between calls (docs/PERFORMANCE_LOG.md log 13a); rounds cost seconds, not a
      start-up.
  W2  single stream: 1 request, 128 prompt ids, 512 output tokens, greedy (ignore_eos). TTFT = median of 3
      max_tokens=1 runs; ms/token = (time of the 512-token run - TTFT) / 511. Every run uses a fresh random prompt,
      so the prefix cache never shortens a later prefill.
  W3  shared prefix: 256 requests = one 2,048-id prefix + 64 unique ids each, 128 output tokens, temperature 0.6,
      ignore_eos; two engines one after the other (prefix caching on, then off). tok_s/seconds/floor are the
      prefix-on run's; tok_s_prefix_off and floor_s_prefix_off the other's.
  The request lists: benchmarks/workloads.py.

--shape writes config.json + a stand-in tokenizer (benchmarks/shapes.py) and loads random weights
(load_format="dummy"); --model DIR loads the checkpoint's weights (or --load-format dummy).

--scale S (smoke runs only) divides every workload length (prompt lengths, max_tokens, W2/W3 sizes) by S, keeping
the same random draws; it defaults to 8 for --shape tiny (W1 prompts 12-128 ids, outputs 12-128 tokens) and 1
otherwise. The floor is computed for the lengths actually run.

Roofline floor: benchmarks/roofline.py (and benchmarks/WORKLOADS.md).

--compare hf runs transformers' continuous batching (benchmarks/hf_peer.py) in the same process after nanoserve's
engine has been closed (so both get the whole GPU), on one GPU whatever --tp is, on the first --hf-num-prompts
requests (default 64 for W1 and W3; W2 is one request), with per-request max_new_tokens = the workload's max_tokens.
nanoserve is also timed on that subset (same engine, after its main run, every id shifted by one so the main run's
prefix cache cannot help; same lengths): `tok_s_hf_subset`, the like-for-like number next to `hf_tok_s`.

--structured-outputs JSON (W1, W2) constrains every request, e.g. '{"regex": "[t0-9]+"}' (every stand-in token
matches), to time the bitmasks: their filling, their transfer and, under async scheduling, the wait of each
step's sampling for them.

--compare bf16 (with --quantization and/or --kv-cache-dtype) runs the same workload again in a second engine
without them, after the first is closed: `bf16_tok_s`, `bf16_floor_fraction` (W2: `bf16_ms_per_token` too).

Output: a short table, then, as the LAST line, one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import throughput_report
from benchmarks.gpu import require_cuda
from benchmarks.roofline import REF_HBM_TBS, REF_TFLOPS, check_floors, measure_ceilings, quantized_stats, roofline
from benchmarks.shapes import load_config, model_stats, write_shape
from benchmarks.throughput_args import parse_args
from benchmarks.workloads import Request, fresh, w1_requests, w2_prompts, w3_requests, warmup_prompt

MAX_MODEL_LEN = 4096

# ---- running -----------------------------------------------------------------------------------------------------


def engine_args(args, device: str, load_format: str) -> dict:
    kw = {
        "device": device,
        "dtype": args.dtype,
        "load_format": load_format,
        "max_model_len": MAX_MODEL_LEN,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": not args.no_async_scheduling,
        "async_depth": args.async_depth,
    }
    optional = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "num_kv_blocks": args.num_kv_blocks,
        "attention_backend": args.attention_backend,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_config": args.speculative_config,
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    return kw


def timed_generate(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def _sampling(reqs: list[Request], structured: str | None = None, temperature: float = 0.6):
    from protocol.sampling_params import SamplingParams

    return [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=r.max_tokens, structured_outputs=structured)
        for r in reqs
    ]


def _warmup(llm) -> None:
    from protocol.sampling_params import SamplingParams

    llm.generate(warmup_prompt(), SamplingParams(max_tokens=16), use_tqdm=False)


def run_w1(ctx: dict) -> dict:
    from nanoserve.llm import LLM

    args = ctx["args"]
    reqs = w1_requests(ctx["scale"], args.num_prompts)
    prompts, params = [r.prompt for r in reqs], _sampling(reqs, args.structured_outputs)
    out_tokens = sum(r.max_tokens for r in reqs)
    res: dict = {"num_prompts": len(reqs), "prompt_tokens": sum(len(p) for p in prompts)}
    with LLM(ctx["model_dir"], tensor_parallel_size=args.tp, **ctx["engine_args"]) as llm:
        _warmup(llm)
        seconds = timed_generate(llm, prompts, params)
        res["engine_stats"] = llm.stats()
        # --repeat: the workload again in the same engine, prompts shifted (shift 1 is the HF subset's) so that no
        # round hits another's prefix cache; a paired A/B reads the median, the first round stays the headline
        rounds = [seconds] + [
            timed_generate(llm, [fresh(p, 1 + r) for p in prompts], params) for r in range(1, args.repeat)
        ]
        res["tok_s_rounds"] = [out_tokens / s for s in rounds]
        if ctx["hf"]:
            sub = reqs[: ctx["hf_n"]]
            res["hf_num_prompts"] = len(sub)
            res["tok_s_hf_subset"] = sum(r.max_tokens for r in sub) / timed_generate(
                llm, [fresh(r.prompt) for r in sub], params[: len(sub)]
            )
    res.update(output_tokens=out_tokens, seconds=seconds, tok_s=out_tokens / seconds)
    res["floor"] = roofline(ctx["stats"], reqs, **ctx["roof"])
    if ctx["hf"]:
        from benchmarks.hf_peer import hf_batch, hf_safely

        res.update(hf_safely(hf_batch, ctx, reqs[: ctx["hf_n"]]))
    return res


def run_w2(ctx: dict) -> dict:
    from nanoserve.llm import LLM
    from protocol.sampling_params import SamplingParams

    args = ctx["args"]
    prompts, m = w2_prompts(ctx["scale"])
    if m < 2:
        raise SystemExit("W2 needs at least 2 output tokens: lower --scale")
    greedy = lambda n: SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=n, structured_outputs=args.structured_outputs
    )
    res: dict = {"num_prompts": 1, "prompt_tokens": len(prompts[0])}
    with LLM(ctx["model_dir"], tensor_parallel_size=args.tp, **ctx["engine_args"]) as llm:
        _warmup(llm)
        ttft = statistics.median(timed_generate(llm, [p], greedy(1)) for p in prompts[:3])
        seconds = timed_generate(llm, [prompts[3]], greedy(m))
        res["engine_stats"] = llm.stats()
    res.update(output_tokens=m, seconds=seconds, tok_s=m / seconds, ttft_ms=ttft * 1e3)
    res["ms_per_token"] = (seconds - ttft) / (m - 1) * 1e3
    floor = roofline(ctx["stats"], [Request(prompts[3], m)], **ctx["roof"])
    res["floor"] = floor
    res["floor_ms_per_token"] = sum(floor["step_s"][1:]) / (m - 1) * 1e3
    if ctx["hf"]:
        from benchmarks.hf_peer import hf_safely, hf_single_stream

        res.update(hf_safely(hf_single_stream, ctx, prompts, m))
    return res


def run_w3(ctx: dict) -> dict:
    from nanoserve.llm import LLM

    args = ctx["args"]
    n = args.num_prompts
    res: dict = {}
    for on in (True, False):
        reqs = w3_requests(ctx["scale"], n, prefix_cached=on)
        prompts, params = [r.prompt for r in reqs], _sampling(reqs)
        out_tokens = sum(r.max_tokens for r in reqs)
        eargs = {**ctx["engine_args"], "enable_prefix_caching": on}
        with LLM(ctx["model_dir"], tensor_parallel_size=args.tp, **eargs) as llm:
            _warmup(llm)
            seconds = timed_generate(llm, prompts, params)
            stats = llm.stats()
            if on and ctx["hf"]:
                sub = reqs[: ctx["hf_n"]]
                res["hf_num_prompts"] = len(sub)
                res["tok_s_hf_subset"] = sum(r.max_tokens for r in sub) / timed_generate(
                    llm, [fresh(r.prompt) for r in sub], params[: len(sub)]
                )
        floor = roofline(ctx["stats"], reqs, **ctx["roof"])
        key = "on" if on else "off"
        res[f"tok_s_prefix_{key}"] = out_tokens / seconds
        res[f"seconds_prefix_{key}"] = seconds
        res[f"floor_s_prefix_{key}"] = floor["floor_s"]
        res[f"engine_stats_prefix_{key}"] = stats
        if on:
            res.update(num_prompts=len(reqs), prompt_tokens=sum(len(p) for p in prompts), floor=floor)
            res.update(output_tokens=out_tokens, seconds=seconds, tok_s=out_tokens / seconds)
    if ctx["hf"]:
        from benchmarks.hf_peer import hf_batch, hf_safely

        res.update(hf_safely(hf_batch, ctx, w3_requests(ctx["scale"], n)[: ctx["hf_n"]]))
    return res


# ---- main --------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args = parse_args(argv, __doc__)
    if args.check_floors:
        rows = check_floors(args.hbm_tbs or REF_HBM_TBS, args.tflops or REF_TFLOPS)
        print(json.dumps({"check_floors": rows}))
        return {"check_floors": rows}
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        require_cuda(args.tp)
    if args.shape:
        model_dir, shape = write_shape(args.shape), args.shape
        load_format = args.load_format or "dummy"
    else:
        model_dir, shape = Path(args.model), Path(args.model).resolve().name
        load_format = args.load_format or "auto"
    cfg = load_config(model_dir)
    base_stats = model_stats(cfg, args.dtype)
    stats = quantized_stats(base_stats, args.quantization, args.kv_cache_dtype)
    scale = args.scale or (8 if shape == "tiny" else 1)
    ceilings = measure_ceilings(device, args.hbm_tbs, args.tflops)
    hf_n = args.hf_num_prompts
    ctx = {
        "args": args,
        "device": device,
        "shape": shape,
        "model_dir": str(model_dir),
        "stats": stats,
        "scale": scale,
        "ceilings": ceilings,
        "engine_args": engine_args(args, device, load_format),
        "roof": {
            "hbm_tbs": ceilings["hbm_tbs"],
            "tflops": ceilings["tflops"],
            "tp": args.tp,
            "max_num_seqs": args.max_num_seqs or 256,
        },
        "hf": args.compare == "hf",
        "hf_n": hf_n,
        "hf_kwargs": {"model_dir": str(model_dir), "device": device, "dtype": stats["dtype"], "temperature": 0.6},
    }
    run = {"W1": run_w1, "W2": run_w2, "W3": run_w3}[args.workload]
    res = run(ctx)
    if args.compare == "bf16":  # the same workload without FP8, in a second engine
        plain = {k: v for k, v in ctx["engine_args"].items() if k not in ("quantization", "kv_cache_dtype")}
        base = run({**ctx, "engine_args": plain, "stats": base_stats})
        res["bf16"] = base
    summary = throughput_report.summary(res, ctx)
    sys.stderr.flush()
    print(throughput_report.table(res, ctx))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
