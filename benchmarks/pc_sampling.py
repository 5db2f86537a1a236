"""Where the GPU's warps stall, per kernel and per source line: CUPTI PC sampling through Triton's proton
(``backend="cupti", mode="pcsampling"``) over decode steps of a ModelRunner in this process (random weights).

    python -m benchmarks.pc_sampling --shape qwen3-8b --batch 256 --context 1100 \\
        [--quantization fp8] [--kv-cache-dtype fp8] [--steps 20] [--out pcs.hatchet]
    python -m benchmarks.pc_sampling --summarize pcs.hatchet      # a saved profile, no GPU needed

Prints the kernels by share of the samples with their main stall reasons, then the lines of the top kernels (our
Triton kernels; library kernels have no lines). Reading it: ``selected`` is issuing (high: instruction-bound),
``long_scoreboard`` waiting on global memory, ``wait`` on fixed-latency results, ``barrier`` on bar.sync. Log 25b
found the e4m3 decode attention's byte-wise V transposes this way. Sampling serializes kernels: read shares, not
times. Proton maps samples to lines only for modules loaded after it starts, so the session starts before the model
is built and is paused until the sampled steps. The steps run eager: CUDA graph capture fails under a sampling
session (error 900); only the GEMM algorithms tuned at capture may differ.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

STALLS = (
    "selected",
    "wait",
    "long_scoreboard",
    "short_scoreboard",
    "barrier",
    "math_pipe_throttle",
    "mio_throttle",
    "lg_throttle",
    "dispatch_stall",
    "no_instruction",
)


@dataclass(slots=True)
class Sampled:
    """One kernel's samples at one source line (``line`` None: samples proton could not map to a line)."""

    line: str | None
    samples: int
    stalls: dict[str, int]


def kernel_samples(tree: list) -> dict[str, list[Sampled]]:
    """{kernel: its samples by line} from proton's hatchet JSON (``tree[0]`` the call tree; a node named
    ``file:line@kernel`` is a line of the nearest kernel above it)."""
    out: dict[str, list[Sampled]] = {}

    def walk(node: dict, kernel: str | None) -> None:
        name, metrics = node["frame"]["name"], node.get("metrics", {})
        is_line = "@" in name and kernel is not None
        if not is_line and name != "ROOT":
            kernel = name
        if metrics.get("num_samples") and kernel is not None:
            stalls = {k: metrics.get(f"stalled_{k}", 0) for k in STALLS}
            out.setdefault(kernel, []).append(
                Sampled(short_line(name) if is_line else None, metrics["num_samples"], stalls)
            )
        for child in node.get("children", []):
            walk(child, kernel)

    walk(tree[0], None)
    return out


def short_line(name: str) -> str:
    """``/long/path/kernels/attention_decode.py:101@kernel`` -> ``kernels/attention_decode.py:101``."""
    return "/".join(name.split("@")[0].split("/")[-2:])


def _stall_text(stalls: dict[str, int], total: int, top: int) -> str:
    ranked = sorted(stalls.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {v / total:.1%}" for k, v in ranked if v)


def summarize(tree: list, top_kernels: int = 12, top_lines: int = 8, kernels_with_lines: int = 3) -> str:
    """The report: kernels by share of all samples with their three main stalls (shares of all samples), then the
    lines of the ``kernels_with_lines`` largest."""
    per_kernel = kernel_samples(tree)
    total = sum(s.samples for entries in per_kernel.values() for s in entries)
    if not total:
        return "no samples"
    ranked = sorted(per_kernel.items(), key=lambda kv: -sum(s.samples for s in kv[1]))
    out = [f"{total:,} samples; share, kernel, main stalls"]
    for name, entries in ranked[:top_kernels]:
        n = sum(s.samples for s in entries)
        stalls = {k: sum(s.stalls[k] for s in entries) for k in STALLS}
        out.append(f"{n / total:6.1%}  {name[:60]:60s}  {_stall_text(stalls, total, 3)}")
    for name, entries in ranked[:kernels_with_lines]:
        out.append(f"\n{name[:80]}: lines")
        for s in sorted(entries, key=lambda s: -s.samples)[:top_lines]:
            out.append(
                f"{s.samples / total:6.1%}  {(s.line or '(no line)')[:48]:48s}  {_stall_text(s.stalls, total, 3)}"
            )
    return "\n".join(out)


def sample_decode(args: argparse.Namespace) -> list:
    """Run ``args.steps`` decode steps at ``args.batch`` sequences of ``args.context`` tokens under PC sampling;
    returns the profile's tree."""
    from benchmarks.gpu import require_cuda

    require_cuda(1)
    import torch
    import triton.profiler as proton

    from benchmarks.profile_step import decode_step, make_runner, prefill_prompts

    stem = args.out.removesuffix(".hatchet")
    session = proton.start(stem, backend="cupti", mode="pcsampling")
    proton.deactivate(session)
    blocks_per_seq = (args.context + args.steps) // 16 + 2
    num_blocks = args.batch * blocks_per_seq
    # eager: a CUPTI PC sampling session, even deactivated, makes CUDA graph capture fail (error 900)
    runner = make_runner(args.shape, args.batch, num_blocks, args.quantization, args.kv_cache_dtype, enforce_eager=True)
    slots = list(range(args.batch))
    blocks = [[s * blocks_per_seq + j for j in range(blocks_per_seq)] for s in slots]
    prefill_prompts(runner, slots, args.context, blocks)
    runner.execute(decode_step(1, slots))  # the first decode step compiles what prefill did not
    torch.cuda.synchronize()
    proton.activate(session)
    for i in range(args.steps):
        runner.execute(decode_step(2 + i, slots))
    torch.cuda.synchronize()
    proton.deactivate(session)
    proton.finalize()
    with open(stem + ".hatchet") as f:
        return json.load(f)


def main() -> None:
    from benchmarks.shapes import SHAPES

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--summarize", metavar="FILE", help="print the report of a saved profile (no GPU)")
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES), help="model shape (random weights)")
    p.add_argument("--batch", type=int, default=256, help="decode sequences")
    p.add_argument("--context", type=int, default=1100, help="prompt tokens per sequence before the sampled steps")
    p.add_argument("--steps", type=int, default=20, help="sampled decode steps")
    p.add_argument("--quantization", choices=["fp8"], help="FP8 linear layers (quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an e4m3 KV cache")
    p.add_argument("--out", default="pcs.hatchet", help="where proton writes the profile")
    p.add_argument("--top", type=int, default=12, help="kernels listed")
    args = p.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            tree = json.load(f)
    else:
        tree = sample_decode(args)
    print(summarize(tree, top_kernels=args.top))


if __name__ == "__main__":
    main()
