"""The roofline floor of a workload and the ceilings it is taken at.

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
"""

from __future__ import annotations

import statistics
from collections import deque

from benchmarks.shapes import SHAPES, model_stats, step_weight_bytes
from benchmarks.workloads import Request, w1_requests, w2_prompts, w3_requests

REF_HBM_TBS, REF_TFLOPS = 4.25, 791.0  # one H200's nominal ceilings (benchmarks/WORKLOADS.md)
W1_YARDSTICK_FLOORS = {("qwen3-0.6b", 1): 3.72, ("qwen3-8b", 1): 10.39, ("qwen3-8b", 2): 5.19}


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
