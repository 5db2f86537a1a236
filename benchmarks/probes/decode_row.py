"""Why did a decode row of the bf16 Qwen3-MoE GPU test differ from HF's? A router near-tie (docs/PERFORMANCE_LOG.md
log 31a): its last token's 8th and 9th router logits lie closer than one bf16 step, so any rounding upstream may
pick the other expert.

tests/kernels/test_fused_moe_gpu.py's teacher-forced check prefills two prompts (599 and 32 tokens) of its tiny
bf16 checkpoint and then decodes one token of each. The probe repeats those two steps and prints, per prompt, the
relative error of the decode row and of the same position reached by prefilling the whole prompt, each against HF
transformers in bf16 and in float32, and the prompt's last router margin (tests/support/tiny_moe.router_margins);
``--seed`` picks the prompts (the test's: 11; 0 has the near-tie) and ``--variant`` names what is switched:

    triton        the engine's defaults (the Triton attention kernels)
    torch         the torch attention backend on the GPU
    nomoedecode   decode batches through kernels/fused_moe.py instead of kernels/moe_decode.py
    nosplit       every decode attention in one split (no merge)
    tri-prefill   Triton prefill attention, torch decode attention
    tri-decode    torch prefill attention, Triton decode attention

    python -m benchmarks.probes.decode_row [--seed 0]     (CUDA; every variant)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from tests.support.builders import make_step, worker_config
from tests.support.oracle import rel_err
from tests.support.tiny_moe import WIDE_BF16, router_margins, write_tiny_moe_checkpoint

TABLES = [list(range(40)), [40, 41, 42]]


def engine_rows(ckpt: Path, prompts: list[list[int]], variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode rows [2, vocab], whole-prompt prefill logits [sum of lengths, vocab]) under ``variant``."""
    import kernels.moe_decode as moe_decode
    from kernels.attention import TorchAttentionBackend
    from kernels.triton_attention import TritonAttentionBackend
    from worker.model_runner import ModelRunner

    saved = moe_decode.MAX_TOKENS, TritonAttentionBackend.num_decode_splits
    if variant == "nomoedecode":
        moe_decode.MAX_TOKENS = 0
    if variant == "nosplit":
        TritonAttentionBackend.num_decode_splits = lambda self, *args, **kwargs: 1
    backend = "torch" if variant == "torch" else "triton"
    cfg = worker_config(
        ckpt,
        dtype="bfloat16",
        attention_backend=backend,
        device="cuda",
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )
    try:
        runs = []
        for whole in (False, True):
            runner = ModelRunner(cfg, torch.device("cuda"))
            runner.allocate_kv(128)
            if variant in ("tri-prefill", "tri-decode"):  # the other phase through the torch reference
                phase = "decode" if variant == "tri-prefill" else "prefill"
                setattr(runner.backend, phase, getattr(TorchAttentionBackend(), phase))
            chunks = [p if whole else p[:-1] for p in prompts]
            step = [dict(slot=i, tokens=c, start=0, new_blocks=t) for i, (c, t) in enumerate(zip(chunks, TABLES))]
            logits = runner.forward_logits(make_step(step)).float()
            if not whole:
                logits = runner.forward_logits(
                    make_step([dict(slot=i, tokens=p[-1:]) for i, p in enumerate(prompts)], 1)
                )
            runs.append(logits.float())
        return runs[0], runs[1]
    finally:
        moe_decode.MAX_TOKENS, TritonAttentionBackend.num_decode_splits = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    variants = ["triton", "torch", "nomoedecode", "nosplit", "tri-prefill", "tri-decode"]
    p.add_argument("--variant", nargs="+", choices=variants, default=variants, help="what is switched (module doc)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' random seed")
    args = p.parse_args()
    ckpt = write_tiny_moe_checkpoint(Path(tempfile.mkdtemp()), WIDE_BF16)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, 1000, n).tolist() for n in (600, 33)]
    refs = {}
    for name, dtype in (("hf bf16", torch.bfloat16), ("hf f32", torch.float32)):
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).cuda().eval()
        with torch.no_grad():
            refs[name] = [hf(torch.tensor([q], device="cuda")).logits[0, -1].float() for q in prompts]
        if dtype == torch.float32:
            margins = [router_margins(hf, q)[-1].item() for q in prompts]
        del hf
    print("last token's router margin per prompt (HF float32):", " ".join(f"{m:.4f}" for m in margins))
    print(f"{'variant':12s} {'prompt':>6s} {'decode~hf bf16':>15s} {'decode~hf f32':>14s} {'prefill~hf bf16':>16s}")
    for variant in args.variant:
        decode, whole = engine_rows(ckpt, prompts, variant)
        ends = np.cumsum([len(q) for q in prompts]) - 1
        for i, end in enumerate(ends):
            bf16, f32 = refs["hf bf16"][i], refs["hf f32"][i]
            row = f"{rel_err(decode[i], bf16):15.4f} {rel_err(decode[i], f32):14.4f} {rel_err(whole[end], bf16):16.4f}"
            print(f"{variant:12s} {i:6d} {row}")


if __name__ == "__main__":
    main()
