"""The command line of benchmarks/throughput.py: which workload, which model or shape, and the engine arguments."""

from __future__ import annotations

import argparse
import json

from benchmarks.shapes import SHAPES
from coordinator.config import ATTENTION_BACKENDS, DTYPES
from settings.defaults import DTYPE_ALIASES


def parse_args(argv=None, doc: str = "") -> argparse.Namespace:
    """benchmarks/throughput.py's flags, checked; ``doc``: its docstring (the help's description)."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
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
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'; see README',
    )
    p.add_argument("--structured-outputs", help="W1/W2: every request under this constraint (JSON, e.g. a regex)")
    p.add_argument("--scale", type=int, help="divide all workload lengths by S (default 8 for --shape tiny, else 1)")
    p.add_argument("--hbm-tbs", type=float, help="use this bandwidth (TB/s) instead of measuring")
    p.add_argument("--tflops", type=float, help="use this matmul rate (TFLOP/s) instead of measuring")
    p.add_argument("--check-floors", action="store_true", help="print the floors at the nominal H200 ceilings")
    args = p.parse_args(argv)
    args.dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    if not args.check_floors:
        if not args.workload:
            p.error("--workload is required")
        if not (args.model or args.shape):
            p.error("one of --model or --shape is required")
        if args.repeat < 1 or (args.repeat > 1 and args.workload != "W1"):
            p.error(f"--repeat {args.repeat}: a count >= 1, and more than 1 only for W1")
        if args.compare == "bf16" and not (args.quantization or args.kv_cache_dtype == "fp8"):
            p.error("--compare bf16 compares an FP8 run (--quantization fp8 / --kv-cache-dtype fp8) with a 16-bit one")
        if args.structured_outputs and args.workload == "W3":
            p.error("--structured-outputs applies to W1 and W2")
    return args
