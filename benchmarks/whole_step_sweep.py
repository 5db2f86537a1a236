"""Tilings of the whole-step attention kernel (kernels/attention_flat.py, what a step with prefill tokens runs in
its CUDA graph) on the steps the workloads make: W3's prefill of ~2k-token prompts, W1's shorter ones, and a mixed
step under load (a prompt chunk beside decode rows). Each tiling (rows, keys, warps, stages) x programs per SM is
checked against the torch reference, then timed as a CUDA-graph replay (the device's time); the default first.
The last line is JSON: each case's fastest tiling and programs per SM, its time and the default's (2 a SM).

    python -m benchmarks.whole_step_sweep [--cases w3 w3mixed w1_8b mixed_8b] [--pps 1 2 3]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from benchmarks.attention_inputs import REF, TOL, make_pool, prefill_meta, rel_err
from benchmarks.attention_sweeps import graph_ms
from benchmarks.gpu import require_cuda
from kernels.attention_flat import whole_step_attention, work_layout

HEAD_DIM = 128
# name: (q heads, kv heads, [(cached prefix, new tokens)] per sequence)
CASES = {
    "w3": (16, 8, [(0, 2048)] * 4),  # W3 with caching off: an 8,192-token step of four fresh prompts
    "w3mixed": (16, 8, [(1024, 1088), (0, 2112), (0, 2112), (0, 2112)] + [(2150, 1)] * 96),
    "w1_8b": (32, 8, [(0, 1024)] * 8),
    "mixed_8b": (32, 8, [(0, 231)] + [(900 + 13 * i, 1) for i in range(25)]),  # ITL at 50% load
}
TILINGS = [  # (rows, keys, warps, stages); the first is the default
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 2),
    (64, 128, 8, 2),
    (128, 64, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
]


def causal_flop(chunks: list[tuple[int, int]], heads: int) -> float:
    """2 matmuls x 2 flop/MAC x head_dim x visible (query, key) pairs x q heads."""
    pairs = sum(n * p + n * (n + 1) / 2 for p, n in chunks)
    return 4 * HEAD_DIM * heads * pairs


def run_case(name: str, pps_list: list[int], dtype: torch.dtype) -> dict:
    heads, kv_heads, chunks = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_lens, q_lens = [p + n for p, n in chunks], [n for _, n in chunks]
    k_cache, v_cache, table = make_pool(kv_lens, 16, dtype, gen, kv_heads)
    tokens, n = sum(q_lens), len(chunks)
    q = torch.randn(tokens, heads, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
    out = torch.empty_like(q)
    ref = REF.prefill(q, k_cache, v_cache, prefill_meta(q_lens, kv_lens, table), HEAD_DIM**-0.5)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flop = causal_flop(chunks, heads)
    print(f"\n{name}: {heads} q / {kv_heads} kv heads, {n} sequences, {tokens} tokens, {flop / 1e9:.1f} GFLOP")
    print(f"  {'rows,keys,warps,stages':>24s} " + " ".join(f"{f'{p}/SM ms':>9s} {'TFLOP/s':>7s}" for p in pps_list))
    timed: dict[tuple, float] = {}
    for tiles in TILINGS:
        cu_host, items = work_layout(np.array(q_lens), heads, kv_heads, tiles[0])
        cu = torch.from_numpy(cu_host).cuda()
        work = torch.tensor([items, n], dtype=torch.int32, device="cuda")
        cells = []
        for pps in pps_list:

            def call(tiles=tiles, pps=pps, cu=cu, work=work):
                whole_step_attention(
                    q, k_cache, v_cache, cu, seq_lens, table, work, HEAD_DIM**-0.5, out, n, pps * sms, tiles
                )

            try:
                call()
                err = rel_err(out, ref)
            except Exception as e:  # e.g. out of shared memory or registers for the largest tiles
                cells.append(f"{type(e).__name__[:17]:>17s}")
                continue
            if err > TOL[dtype]:
                cells.append(f"{'MISMATCH':>9s} {err:7.1e}")
                continue
            ms = timed[(*tiles, pps)] = graph_ms(call)
            cells.append(f"{ms:9.4f} {flop / ms / 1e9:7.0f}")
        print(f"  {str(tiles):>24s} " + " ".join(cells))
    torch.cuda.empty_cache()
    best = min(timed, key=timed.get)
    default = timed.get((*TILINGS[0], 2))
    return {"case": name, "best": list(best), "best_ms": timed[best], "default_ms": default}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="the steps to time (all)")
    p.add_argument("--pps", type=int, nargs="+", default=[1, 2, 3], help="programs per SM")
    a = p.parse_args()
    require_cuda()
    print(torch.cuda.get_device_name())
    bests = [run_case(name, a.pps, torch.bfloat16) for name in a.cases]
    print(json.dumps(bests))  # the last line: each case's fastest (rows, keys, warps, stages, programs per SM)


if __name__ == "__main__":
    main()
