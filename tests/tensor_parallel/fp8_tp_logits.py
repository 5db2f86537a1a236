"""Teacher-forced logits of a block-FP8 checkpoint under tensor parallelism (one process per rank, started by
torchrun, gloo on the CPU) against HF on the dequantized weights with FP8-quantized activations:

    torchrun --nproc-per-node 2 -m tests.tensor_parallel.fp8_tp_logits --model FP8_DIR --reference DEQUANTIZED_DIR

Rank 0 prints one JSON line; the exit code says whether every token's logits agree to 1e-4 (relative)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from comm.parallel import set_tp
from model.linear import RowParallelLinear
from tests.support.builders import make_step, worker_config
from tests.support.fp8_checkpoints import capture_linear_inputs, hf_logits, rows_rel_err


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--reference", required=True)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    set_tp(rank, world)
    from worker.model_runner import ModelRunner

    runner = ModelRunner(worker_config(a.model), torch.device("cpu"))
    runner.allocate_kv(16)
    inputs = capture_linear_inputs(runner.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, n).tolist() for n in (37, 6)]
    seqs = [dict(slot=i, tokens=t, start=0, new_blocks=[4 * i, 4 * i + 1, 4 * i + 2]) for i, t in enumerate(prompts)]
    logits = runner.forward_logits(make_step(seqs))
    for name, x in inputs.items():  # a row-parallel layer's input is this rank's columns: gather them all
        if isinstance(runner.model.get_submodule(name), RowParallelLinear):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous())
            inputs[name] = torch.cat(parts, dim=-1)
    code = 0
    if rank == 0:
        refs = hf_logits(Path(a.reference), prompts, act_group=128, engine_inputs=inputs)
        err = rows_rel_err(list(logits.split([len(t) for t in prompts])), refs).max().item()
        ok = err < 1e-4
        print(json.dumps({"tp": world, "max_row_rel_err": err, "ok": ok}))
        code = 0 if ok else 1
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
