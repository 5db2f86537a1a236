"""Verify rows under tensor parallelism, one process per rank, started by torchrun:

    torchrun --nproc-per-node 2 -m tests.worker.tp_verify --model DIR --case JSON

``--case``: {"prompts": [[ids], ...], "steps": [[{"slot", "tokens", ...}, ...], ...], "drafts": [[d, ...] | null]}
(steps as tests.support.builders.make_step's rows). Rank 0 prints one JSON line: each step's tokens and accepted
counts, and whether every rank holds the same computed lengths and last tokens after the last step."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from comm.parallel import all_gather_stack, set_tp
from protocol.codec import decode, encode
from protocol.messages import StepCommand
from tests.support.builders import i32, make_step, worker_config


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--case", required=True)
    a = p.parse_args()
    case = json.loads(a.case)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    set_tp(rank, world)
    torch.set_num_threads(1)
    from worker.model_runner import ModelRunner

    runner = ModelRunner(worker_config(a.model), torch.device("cpu"))
    runner.allocate_kv(64)
    out = []
    for i, (rows, drafts) in enumerate(zip(case["steps"], case["drafts"])):
        step = make_step(rows, i)
        step.draft_counts = None if drafts is None else i32(drafts)
        done = runner.launch(decode(encode(step), expect=StepCommand))
        tokens = done.wait()
        accepted = None if done.num_accepted is None else done.num_accepted.tolist()
        out.append({"tokens": tokens.tolist(), "accepted": accepted})
    runner.launch(make_step([], len(out)))  # settles the last verify step's lengths
    slots = sorted({r["slot"] for rows in case["steps"] for r in rows})
    state = torch.cat([torch.from_numpy(runner.num_computed[slots]), runner.last_tokens[slots]])
    every = all_gather_stack(state)
    if rank == 0:
        agree = bool((every == every[0]).all())
        print(json.dumps({"steps": out, "ranks_agree": agree, "num_computed": runner.num_computed[slots].tolist()}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
