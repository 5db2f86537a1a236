"""Torchrun-style TP smoke test: a coordinator waits for an external worker group started by torchrun, generates
greedily, and checks the tokens against tensor_parallel_size=1 (spawned workers). Runs on CPU (gloo) or CUDA (NCCL).

    python -m tests.tensor_parallel.tp_smoke --model DIR [--device cuda] [--tp 2] [--dtype float32]

It starts ``torchrun --nproc-per-node TP -m worker --coordinator tcp://127.0.0.1:PORT`` itself and exits 0 when
the tokens match (prints one JSON line with the result).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from tests.support.processes import ROOT, free_port, torchrun_cmd
from tests.support.timeouts import HANG_S, START_S


def prompts() -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(3)
    return [rng.integers(0, 400, n).tolist() for n in (5, 23, 40, 1, 64, 12)]


def run(model: str, device: str, tp: int, dtype: str, max_tokens: int) -> dict:
    from nanoserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine_args = dict(device=device, dtype=dtype, max_model_len=256, num_kv_blocks=128, enforce_eager=True)
    engine_args["worker_timeout_s"] = START_S  # torchrun's ranks start slowly on a busy host
    with LLM(model, tensor_parallel_size=1, **engine_args) as llm:
        ref = [c.token_ids for c in llm.generate(prompts(), params, use_tqdm=False)]

    address = f"tcp://127.0.0.1:{free_port()}"
    cmd = torchrun_cmd(tp, "worker", "--coordinator", address)
    group = subprocess.Popen(cmd, cwd=str(ROOT), stdin=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        llm = LLM(model, tensor_parallel_size=tp, external_workers=True, worker_address=address, **engine_args)
        with llm:
            got = [c.token_ids for c in llm.generate(prompts(), params, use_tqdm=False)]
            hellos = llm.engine.workers.num_kv_blocks
        elapsed = time.monotonic() - t0
        code = group.wait(timeout=HANG_S)
    finally:
        if group.poll() is None:
            group.kill()
            group.wait()
    return {"tp": tp, "device": device, "match": got == ref, "torchrun_exit": code, "kv_blocks": hellos, "s": elapsed}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    result = run(a.model, a.device, a.tp, a.dtype, a.max_tokens)
    print(json.dumps(result), flush=True)
    return 0 if result["match"] and result["torchrun_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
