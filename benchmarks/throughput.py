"""End-to-end throughput of nanoserve on the workloads of WORKLOADS.md, against a roofline floor (and HF, optionally).

    python -m benchmarks.throughput --workload W1|W2|W3 (--model DIR | --shape NAME)   # NAME: benchmarks/shapes.py
        [--tp N] [--enforce-eager] [--num-prompts N] [--hf-num-prompts N] [--repeat N]
        [--device cuda|cpu] [--dtype bfloat16] [--max-num-seqs N] [--max-num-batched-tokens N] [--block-size N]
        [--gpu-memory-utilization F] [--num-kv-blocks N] [--scale S] [--hbm-tbs X] [--tflops X]
        [--quantization fp8] [--kv-cache-dtype fp8] [--compare hf|bf16]
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

--shape writes config.json + a stand-in tokenizer (benchmarks/shapes.py) and loads random weights
(load_format="dummy"); --model DIR loads the checkpoint's weights (or --load-format dummy).

--scale S (smoke runs only) divides every workload length (prompt lengths, max_tokens, W2/W3 sizes) by S, keeping
the same random draws; it defaults to 8 for --shape tiny (W1 prompts 12-128 ids, outputs 12-128 tokens) and 1
otherwise. The floor is computed for the lengths actually run.

Roofline floor (benchmarks/WORKLOADS.md): ceilings measured at start on CUDA (device-to-device copy of 2 x 1 GiB:
bytes read + written / time; bf16 8192^3 matmul) on GPU 0, or --hbm-tbs/--tflops; on CPU, one H200's nominal
figures (4.25 TB/s, 791 TFLOP/s) are used (so the CPU "fraction" means nothing). Floor = prefill + decode:
  prefill: (2 x layer params x prompt ids + 2 x lm_head params per sequence + causal attention FLOPs
           4 x head_dim x q_heads x layers x visible (query, key) pairs) / TFLOP/s; prefix-cached ids cost nothing
           but are visible keys.
  decode:  all sequences start together (at most max_num_seqs running; a finished one is replaced by the next
           waiting one); step k reads all weights (decoder layers + lm_head) plus the KV of every running sequence
           at its context length prompt + k, at the measured bandwidth; a sequence runs max_tokens steps. Of a
           mixture of experts a step of B sequences reads only the experts they route to: E * (1 - (1 - k/E)^B)
           per MoE layer expected under uniform routing (shapes.step_weight_bytes); prefill multiplies through
           the top-k experts of each token only.
  TP divides both by tp (perfect sharding). fraction = floor_s / seconds.
  --quantization fp8: the decoder layers' weights count 1 byte each (the LM head stays 16-bit) and their prefill
  FLOPs half (Hopper's FP8 tensor cores run twice the bf16 rate); --kv-cache-dtype fp8: 1 byte per KV element.
At 4.25 TB/s and 791 TFLOP/s this gives WORKLOADS.md's W1 floors: 3.72 s (0.6B), 10.39 s (8B), 5.19 s (8B, TP=2).

--compare hf runs transformers' continuous batching (benchmarks/hf_peer.py) in the same process after nanoserve's
engine has been closed (so both get the whole GPU), on one GPU whatever --tp is, on the first --hf-num-prompts
requests (default 64 for W1 and W3; W2 is one request), with per-request max_new_tokens = the workload's max_tokens.
nanoserve is also timed on that subset (same engine, after its main run, every id shifted by one so the main run's
prefix cache cannot help; same lengths): `tok_s_hf_subset`, the like-for-like number next to `hf_tok_s`.

--compare bf16 (with --quantization and/or --kv-cache-dtype) runs the same workload again in a second engine
without them, after the first is closed: `bf16_tok_s`, `bf16_floor_fraction` (W2: `bf16_ms_per_token` too).

Output: a short table, then, as the LAST line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu import require_cuda
from benchmarks.shapes import SHAPES, load_config, model_stats, step_weight_bytes, write_shape
from coordinator.config import ATTENTION_BACKENDS, DTYPES

REF_HBM_TBS, REF_TFLOPS = 4.25, 791.0  # one H200's nominal ceilings (benchmarks/WORKLOADS.md)
MAX_MODEL_LEN = 4096
W1_YARDSTICK_FLOORS = {("qwen3-0.6b", 1): 3.72, ("qwen3-8b", 1): 10.39, ("qwen3-8b", 2): 5.19}

# ---- workloads ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int
    cached: int = 0  # prompt ids a perfect prefix cache would already hold (floor only)


def _cut(n: int, scale: int) -> int:
    return max(1, n // scale)


def w1_requests(scale: int = 1, num_prompts: int | None = None) -> list[Request]:
    """nano-vllm bench.py's draws, in its order: all prompts first, then all max_tokens."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    reqs = [Request(p[: _cut(len(p), scale)], _cut(m, scale)) for p, m in zip(prompts, max_tokens)]
    return reqs[:num_prompts] if num_prompts else reqs


def w2_prompts(scale: int = 1, count: int = 4) -> tuple[list[list[int]], int]:
    """``count`` fresh 128-id prompts (3 for TTFT, 1 for the full run) and the output length (512)."""
    rng = random.Random(0)
    return [[rng.randint(0, 10000) for _ in range(_cut(128, scale))] for _ in range(count)], _cut(512, scale)


def w3_requests(scale: int = 1, num_prompts: int | None = None, prefix_cached: bool = True) -> list[Request]:
    rng = random.Random(0)
    plen = _cut(2048, scale)
    prefix = [rng.randint(0, 10000) for _ in range(plen)]
    reqs = [
        Request(prefix + [rng.randint(0, 10000) for _ in range(_cut(64, scale))], _cut(128, scale))
        for _ in range(num_prompts or 256)
    ]
    if prefix_cached:
        for r in reqs[1:]:
            r.cached = plen
    return reqs


def fresh(prompt: list[int], shift: int = 1) -> list[int]:
    """The same prompt shifted by ``shift`` ids: same lengths and distribution, no prefix-cache hit on the original
    or on another shift."""
    return [(t + shift) % 10001 for t in prompt]


def warmup_prompt() -> list[int]:
    return [random.Random(1).randint(0, 10000) for _ in range(8)]


# ---- roofline ----------------------------------------------------------------------------------------------------


def roofline(
    stats: dict, reqs: list[Request], *, hbm_tbs: float, tflops: float, tp: int = 1, max_num_seqs: int = 256
) -> dict:
    """Floor seconds for ``reqs`` (see the module docstring); ``step_s`` lists each decode step's floor."""
    flops_rate, bw = tflops * 1e12 * tp, hbm_tbs * 1e12 * tp
    k_attn = 4 * stats["head_dim"] * stats["num_heads"] * stats["num_layers"]
    prefill_flops = 0.0
    for r in reqs:
        c, n = r.cached, len(r.prompt) - r.cached
        prefill_flops += 2 * stats["layer_params"] * n * stats.get("layer_flop_cost", 1.0) + 2 * stats["lm_head_params"]
        prefill_flops += k_attn * (n * c + n * (n + 1) / 2)
    kv_bytes = stats["kv_bytes_per_token"]
    waiting = deque(reqs)
    ctx: list[int] = []  # running sequences' context lengths
    left: list[int] = []  # and their remaining steps
    step_s = []
    while waiting or ctx:
        while waiting and len(ctx) < max_num_seqs:
            r = waiting.popleft()
            ctx.append(len(r.prompt))
            left.append(r.max_tokens)
        step_s.append((step_weight_bytes(stats, len(ctx)) + kv_bytes * sum(ctx)) / bw)
        keep = [i for i, m in enumerate(left) if m > 1]
        ctx = [ctx[i] + 1 for i in keep]
        left = [left[i] - 1 for i in keep]
    prefill_s = prefill_flops / flops_rate
    decode_s = sum(step_s)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "floor_s": prefill_s + decode_s, "step_s": step_s}


def check_floors(hbm_tbs: float = REF_HBM_TBS, tflops: float = REF_TFLOPS) -> list[dict]:
    """Floors at the given ceilings for the real shapes; W1 next to the yardsticks of benchmarks/WORKLOADS.md."""
    rows = []
    print(f"floors at {hbm_tbs} TB/s, {tflops} TFLOP/s (W1 yardsticks from benchmarks/WORKLOADS.md)")
    for shape, tp in [("qwen3-0.6b", 1), ("qwen3-8b", 1), ("qwen3-8b", 2), ("llama3.1-8b", 1), ("qwen3-30b-a3b", 1)]:
        st = model_stats(SHAPES[shape])
        kw = {"hbm_tbs": hbm_tbs, "tflops": tflops, "tp": tp}
        w1 = roofline(st, w1_requests(), **kw)
        ps, m = w2_prompts()
        w2 = roofline(st, [Request(ps[0], m)], **kw)
        w3_on = roofline(st, w3_requests(prefix_cached=True), **kw)
        w3_off = roofline(st, w3_requests(prefix_cached=False), **kw)
        ref = W1_YARDSTICK_FLOORS.get((shape, tp))
        w1_out = sum(r.max_tokens for r in w1_requests())
        row = {
            "shape": shape,
            "tp": tp,
            "w1_floor_s": round(w1["floor_s"], 3),
            "w1_prefill_s": round(w1["prefill_s"], 3),
            "w1_decode_s": round(w1["decode_s"], 3),
            "w1_ceiling_tok_s": round(w1_out / w1["floor_s"]),
            "w1_reference_floor_s": ref,
            "w2_floor_ms_per_token": round(sum(w2["step_s"][1:]) / (m - 1) * 1e3, 4),
            "w3_floor_s_prefix_on": round(w3_on["floor_s"], 3),
            "w3_floor_s_prefix_off": round(w3_off["floor_s"], 3),
        }
        rows.append(row)
        print(
            f"  {shape:13s} TP={tp}  W1 floor {row['w1_floor_s']:7.3f} s (prefill {row['w1_prefill_s']:.3f} + decode "
            f"{row['w1_decode_s']:.3f}; ceiling {row['w1_ceiling_tok_s']:,} tok/s)  reference {ref} s | "
            f"W2 {row['w2_floor_ms_per_token']:.3f} ms/token | W3 on {row['w3_floor_s_prefix_on']:.3f} s, "
            f"off {row['w3_floor_s_prefix_off']:.3f} s"
        )
    return rows


def measure_ceilings(device: str, hbm_tbs: float | None, tflops: float | None) -> dict:
    """HBM TB/s (copy: bytes read + written) and bf16 TFLOP/s (8192^3 matmul) on GPU 0; nominal on CPU."""
    if device != "cuda":
        return {
            "hbm_tbs": hbm_tbs or REF_HBM_TBS,
            "tflops": tflops or REF_TFLOPS,
            "source": "nominal (one H200's figures, not measured: the fraction means nothing on CPU)",
        }
    import torch

    def timed(fn, iters: int) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    dev = torch.device("cuda", 0)
    source = []
    if hbm_tbs is None:
        n = 1 << 29  # 1 GiB of bf16 per buffer
        src = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
        dst = torch.empty_like(src)
        hbm_tbs = 2 * src.numel() * src.element_size() / timed(lambda: dst.copy_(src), 20) / 1e12
        del src, dst
        source.append("HBM measured (2 x 1 GiB D2D copy)")
    else:
        source.append("HBM from --hbm-tbs")
    if tflops is None:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        tflops = 2 * 8192**3 / timed(lambda: a @ b, 20) / 1e12
        del a, b
        source.append("TFLOP/s measured (bf16 8192^3 matmul)")
    else:
        source.append("TFLOP/s from --tflops")
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return {"hbm_tbs": hbm_tbs, "tflops": tflops, "source": f"{', '.join(source)} on {torch.cuda.get_device_name(0)}"}


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
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    return kw


def quantized_stats(stats: dict, quantization: str | None, kv_cache_dtype: str | None) -> dict:
    """``model_stats`` for FP8 decoder-layer weights (1 byte, half the prefill FLOP time) and an e4m3 KV cache."""
    out = dict(stats)
    if quantization == "fp8":
        expert_params = stats["expert_bytes"] // stats["dtype_bytes"]
        always_read = stats["layer_params"] - stats["moe_layers"] * stats["top_k"] * expert_params  # all but experts
        out["weight_bytes_per_step"] = always_read + stats["lm_head_params"] * stats["dtype_bytes"]
        out["expert_bytes"] = expert_params
        out["layer_flop_cost"] = 0.5
    if kv_cache_dtype == "fp8":
        out["kv_bytes_per_token"] = stats["kv_bytes_per_token"] // stats["dtype_bytes"]
    return out


def timed_generate(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def _sampling(reqs: list[Request], temperature: float = 0.6):
    from protocol.sampling_params import SamplingParams

    return [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=r.max_tokens) for r in reqs]


def _warmup(llm) -> None:
    from protocol.sampling_params import SamplingParams

    llm.generate(warmup_prompt(), SamplingParams(max_tokens=16), use_tqdm=False)


def run_w1(ctx: dict) -> dict:
    from client.llm import LLM

    args = ctx["args"]
    reqs = w1_requests(ctx["scale"], args.num_prompts)
    prompts, params = [r.prompt for r in reqs], _sampling(reqs)
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
        res.update(_hf_safely(hf_batch, ctx, reqs[: ctx["hf_n"]]))
    return res


def run_w2(ctx: dict) -> dict:
    from client.llm import LLM
    from protocol.sampling_params import SamplingParams

    args = ctx["args"]
    prompts, m = w2_prompts(ctx["scale"])
    if m < 2:
        raise SystemExit("W2 needs at least 2 output tokens: lower --scale")
    greedy = lambda n: SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
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
        res.update(_hf_safely(hf_single_stream, ctx, prompts, m))
    return res


def run_w3(ctx: dict) -> dict:
    from client.llm import LLM

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
        res.update(_hf_safely(hf_batch, ctx, w3_requests(ctx["scale"], n)[: ctx["hf_n"]]))
    return res


# ---- the HF peer (after nanoserve's engine is closed) ------------------------------------------------------------


def _hf_safely(fn, *args) -> dict:
    """Run an HF peer measurement; a failure is reported (stderr + ``hf_error``) without losing nanoserve's run."""
    try:
        return fn(*args)
    except Exception as e:
        traceback.print_exc()
        return {"hf_error": f"{type(e).__name__}: {e}"}


def hf_batch(ctx: dict, sub: list[Request]) -> dict:
    from benchmarks.hf_peer import HFPeer

    hints = {"max_prompt_len": max(len(r.prompt) for r in sub), "max_new_tokens": max(r.max_tokens for r in sub)}
    with HFPeer(**ctx["hf_kwargs"], **hints, num_requests=len(sub)) as peer:
        peer.warmup()
        hf_s, hf_tokens = peer.run([r.prompt for r in sub], [r.max_tokens for r in sub])
    return {"hf_seconds": hf_s, "hf_output_tokens": hf_tokens, "hf_tok_s": hf_tokens / hf_s}


def hf_single_stream(ctx: dict, prompts: list[list[int]], m: int) -> dict:
    from benchmarks.hf_peer import HFPeer

    hints = {"max_prompt_len": len(prompts[0]), "max_new_tokens": m, "num_requests": 1}
    with HFPeer(**{**ctx["hf_kwargs"], "temperature": 0.0}, **hints) as peer:
        peer.warmup()
        hf_ttft = statistics.median(peer.run([p], [1])[0] for p in prompts[:3])
        hf_s, hf_tokens = peer.run([prompts[3]], [m])
    return {
        "hf_seconds": hf_s,
        "hf_output_tokens": hf_tokens,
        "hf_tok_s": hf_tokens / hf_s,
        "hf_ttft_ms": hf_ttft * 1e3,
        "hf_ms_per_token": (hf_s - hf_ttft) / (m - 1) * 1e3,
    }


# ---- main --------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--workload", choices=["W1", "W2", "W3"], help="the workload (see the module docstring)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face checkpoint directory (Qwen3)")
    src.add_argument("--shape", choices=list(SHAPES), help="a real model shape with random weights")
    p.add_argument("--load-format", choices=["auto", "dummy"], help="default: dummy for --shape, auto for --model")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-async-scheduling", action="store_true", help="wait for each step before the next")
    p.add_argument(
        "--async-depth", type=int, default=2, choices=[1, 2], help="steps sent ahead of the results read back"
    )
    p.add_argument(
        "--compare",
        choices=["hf", "bf16"],
        help="hf: the Hugging Face peer; bf16: the 16-bit engine (same workload)",
    )
    p.add_argument("--num-prompts", type=int, help="W1/W3: keep the first N requests (smoke runs)")
    p.add_argument("--repeat", type=int, default=1, help="W1: run the workload N times in one engine (median too)")
    p.add_argument("--hf-num-prompts", type=int, default=64, help="W1/W3: requests given to the HF peer (first N)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="default: auto (the checkpoint's)")
    p.add_argument("--max-num-seqs", type=int, help="engine argument (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, help="engine argument (default: the engine's)")
    p.add_argument("--block-size", type=int, help="engine argument (default: the engine's)")
    p.add_argument("--gpu-memory-utilization", type=float, help="engine argument (default: the engine's)")
    p.add_argument("--num-kv-blocks", type=int, help="engine argument (default: sized from memory)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, help="engine argument (default: auto)")
    p.add_argument("--quantization", choices=["fp8"], help="FP8 linear layers (a 16-bit model quantized at load)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], help="fp8: an e4m3 KV cache")
    p.add_argument("--scale", type=int, help="divide all workload lengths by S (default 8 for --shape tiny, else 1)")
    p.add_argument("--hbm-tbs", type=float, help="use this bandwidth (TB/s) instead of measuring")
    p.add_argument("--tflops", type=float, help="use this matmul rate (TFLOP/s) instead of measuring")
    p.add_argument("--check-floors", action="store_true", help="print the floors at the nominal H200 ceilings")
    args = p.parse_args(argv)
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    args.dtype = aliases.get(args.dtype, args.dtype)
    if not args.check_floors:
        if not args.workload:
            p.error("--workload is required")
        if not (args.model or args.shape):
            p.error("one of --model or --shape is required")
        if args.repeat < 1 or (args.repeat > 1 and args.workload != "W1"):
            p.error(f"--repeat {args.repeat}: a count >= 1, and more than 1 only for W1")
        if args.compare == "bf16" and not (args.quantization or args.kv_cache_dtype == "fp8"):
            p.error("--compare bf16 compares an FP8 run (--quantization fp8 / --kv-cache-dtype fp8) with a 16-bit one")
    return args


def _sig(x: float, digits: int = 5) -> float:
    """Round to ``digits`` significant digits (tiny CPU floors are microseconds)."""
    return float(f"{x:.{digits}g}")


def _fmt_table(res: dict, ctx: dict) -> str:
    args, floor, ceil = ctx["args"], res["floor"], ctx["ceilings"]
    lines = [
        f"{args.workload}  shape {ctx['shape']}  tp {args.tp}  device {ctx['device']}  dtype {ctx['stats']['dtype']}"
        f"  scale 1/{ctx['scale']}  requests {res['num_prompts']}  prompt tokens {res['prompt_tokens']:,}",
        f"ceilings   {ceil['hbm_tbs']:.2f} TB/s, {ceil['tflops']:.0f} TFLOP/s  [{ceil['source']}]",
        f"nanoserve  {res['output_tokens']:,} output tokens in {res['seconds']:.3f} s = {res['tok_s']:,.1f} tok/s",
        f"floor      {floor['floor_s']:.3f} s (prefill {floor['prefill_s']:.3f} s + decode {floor['decode_s']:.3f} s, "
        f"{len(floor['step_s'])} steps) -> {floor['floor_s'] / res['seconds']:.1%} of the roofline",
    ]
    if len(res.get("tok_s_rounds", ())) > 1:
        rounds = ", ".join(f"{x:,.0f}" for x in res["tok_s_rounds"])
        lines.append(f"rounds     {rounds} tok/s (median {statistics.median(res['tok_s_rounds']):,.0f})")
    if args.workload == "W2":
        lines.append(
            f"W2         TTFT {res['ttft_ms']:.2f} ms, {res['ms_per_token']:.3f} ms/token after the first "
            f"(floor {res['floor_ms_per_token']:.3f} ms/token)"
        )
    if args.workload == "W3":
        lines.append(
            f"W3         prefix caching on {res['tok_s_prefix_on']:,.1f} tok/s ({res['seconds_prefix_on']:.3f} s, "
            f"floor {res['floor_s_prefix_on']:.3f} s) | off {res['tok_s_prefix_off']:,.1f} tok/s "
            f"({res['seconds_prefix_off']:.3f} s, floor {res['floor_s_prefix_off']:.3f} s)"
        )
    if "bf16" in res:
        base = res["bf16"]
        lines.append(
            f"16-bit     same workload without FP8: {base['tok_s']:,.1f} tok/s ({base['seconds']:.3f} s, floor "
            f"{base['floor']['floor_s']:.3f} s)"
            + (f", {base['ms_per_token']:.3f} ms/token" if args.workload == "W2" else "")
        )
    if "hf_error" in res:
        lines.append(f"HF peer    FAILED: {res['hf_error']}")
    if "hf_tok_s" in res:
        if args.workload == "W2":
            lines.append(
                f"HF peer    transformers CB, 1 request: {res['hf_tok_s']:,.1f} tok/s, "
                f"TTFT {res['hf_ttft_ms']:.2f} ms, "
                f"{res['hf_ms_per_token']:.3f} ms/token (nanoserve {res['ms_per_token']:.3f})"
            )
        else:
            lines.append(
                f"HF peer    transformers CB on the FIRST {res['hf_num_prompts']} requests: "
                f"{res['hf_tok_s']:,.1f} tok/s "
                f"({res['hf_output_tokens']:,} tokens in {res['hf_seconds']:.2f} s) | nanoserve on the same "
                f"{res['hf_num_prompts']}: {res['tok_s_hf_subset']:,.1f} tok/s | nanoserve on all "
                f"{res['num_prompts']}: {res['tok_s']:,.1f} tok/s"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
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
    floor_s = res["floor"]["floor_s"]
    summary = {
        "workload": args.workload,
        "shape": shape,
        "tp": args.tp,
        "output_tokens": res["output_tokens"],
        "seconds": _sig(res["seconds"]),
        "tok_s": _sig(res["tok_s"]),
        "floor_s": _sig(floor_s),
        "floor_fraction": _sig(floor_s / res["seconds"]),
    }
    if len(res.get("tok_s_rounds", ())) > 1:
        summary.update(
            tok_s_rounds=[_sig(x) for x in res["tok_s_rounds"]],
            tok_s_median=_sig(statistics.median(res["tok_s_rounds"])),
        )
    if args.workload == "W2":
        summary.update(
            ms_per_token=_sig(res["ms_per_token"]),
            ttft_ms=_sig(res["ttft_ms"]),
            floor_ms_per_token=_sig(res["floor_ms_per_token"]),
        )
    if args.workload == "W3":
        summary.update(
            tok_s_prefix_on=_sig(res["tok_s_prefix_on"]),
            tok_s_prefix_off=_sig(res["tok_s_prefix_off"]),
            floor_s_prefix_off=_sig(res["floor_s_prefix_off"]),
        )
    if "bf16" in res:
        base = res["bf16"]
        summary.update(
            bf16_tok_s=_sig(base["tok_s"]), bf16_floor_fraction=_sig(base["floor"]["floor_s"] / base["seconds"])
        )
        if args.workload == "W2":
            summary.update(
                bf16_ms_per_token=_sig(base["ms_per_token"]), bf16_floor_ms_per_token=_sig(base["floor_ms_per_token"])
            )
    if "hf_error" in res:
        summary.update(hf_tok_s=None, hf_error=res["hf_error"])
    if "hf_tok_s" in res:
        summary["hf_tok_s"] = _sig(res["hf_tok_s"])
        if args.workload == "W2":
            summary["hf_ms_per_token"] = _sig(res["hf_ms_per_token"])
        else:
            summary["hf_num_prompts"] = res["hf_num_prompts"]
            summary["tok_s_hf_subset"] = _sig(res["tok_s_hf_subset"])
    summary.update(
        device=device,
        dtype=stats["dtype"],
        quantization=args.quantization or "",
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        scale=scale,
        num_prompts=res["num_prompts"],
        enforce_eager=args.enforce_eager,
        async_depth=0 if args.no_async_scheduling else args.async_depth,
        hbm_tbs=_sig(ceilings["hbm_tbs"], 4),
        tflops=_sig(ceilings["tflops"], 4),
        ceilings_source=ceilings["source"],
    )
    for key in ("engine_stats", "engine_stats_prefix_on", "engine_stats_prefix_off"):
        if key in res:
            summary[key] = res[key]
    sys.stderr.flush()
    print(_fmt_table(res, ctx))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
