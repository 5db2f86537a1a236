"""Teacher-forced logits of a TP group against HF transformers, one process per rank, started by torchrun:

    torchrun --nproc-per-node 2 -m tests.tensor_parallel.tp_logits --model DIR [--device cuda] [--dtype bfloat16]

Rank 0 gathers the vocabulary shards, compares with HF on the same checkpoint and prints one JSON line; the exit
code says whether the relative error is within tolerance (1e-4 in float32, 2e-2 in bf16)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from comm.parallel import set_tp
from tests.support.builders import make_step, worker_config


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    set_tp(rank, world)
    from worker.model_runner import ModelRunner

    backend = "triton" if a.device == "cuda" else "torch"
    cfg = worker_config(a.model, device=a.device, dtype=a.dtype, attention_backend=backend, max_model_len=512)
    runner = ModelRunner(cfg, device)
    runner.allocate_kv(64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 400, n).tolist() for n in (70, 9)]
    seqs = [dict(slot=i, tokens=t, start=0, new_blocks=list(range(i * 8, i * 8 + 8))) for i, t in enumerate(prompts)]
    logits = runner.forward_logits(make_step(seqs))
    code = 0
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).to(device).eval()
        errs, agree = [], []
        offset = 0
        for t in prompts:
            with torch.no_grad():
                ref = hf(torch.tensor([t], device=device)).logits[0].float()
            mine = logits[offset : offset + len(t)].float()
            offset += len(t)
            errs.append(((mine - ref).norm() / ref.norm()).item())
            agree.append((mine.argmax(-1) == ref.argmax(-1)).float().mean().item())
        # float32 on CUDA: the Triton attention's dots run in tf32 (~1e-3), as do HF's cuBLAS defaults on some builds
        tol = {"float32": 1e-4 if a.device == "cpu" else 3e-3}.get(a.dtype, 2e-2)
        ok = max(errs) < tol
        print(json.dumps({"tp": world, "dtype": a.dtype, "device": a.device, "rel_err": errs, "top1": agree, "ok": ok}))
        code = 0 if ok else 1
    else:
        assert logits is None, "only rank 0 may hold full logits"
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
