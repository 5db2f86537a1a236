"""What benchmarks/throughput.py prints of a run: a short table, then one JSON line (its fields)."""

from __future__ import annotations

import statistics


def _sig(x: float, digits: int = 5) -> float:
    """Round to ``digits`` significant digits (tiny CPU floors are microseconds)."""
    return float(f"{x:.{digits}g}")


def table(res: dict, ctx: dict) -> str:
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


def summary(res: dict, ctx: dict) -> dict:
    """The JSON line: the headline figures, the floor fraction, the peers' and the engine's statistics."""
    args, shape, ceilings, stats, scale = ctx["args"], ctx["shape"], ctx["ceilings"], ctx["stats"], ctx["scale"]
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
        device=ctx["device"],
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
    return summary
