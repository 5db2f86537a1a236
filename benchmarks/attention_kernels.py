"""Check and time the Triton attention kernels against the torch reference at Qwen3-8B-like sizes (GPU only).

    python -m benchmarks.attention_kernels [--block-sizes 16 256] [--dtype bf16] [--seed 0]
    python -m benchmarks.attention_kernels --sweep-decode    # decode tilings x split counts on W1/W2-like batches
    python -m benchmarks.attention_kernels --sweep-decode --cases 16,64,700,2000    # q heads, batch, context range
    python -m benchmarks.attention_kernels --sweep-decode --tilings 128,8,2 64,4,3    # keys per tile, warps, stages
    python -m benchmarks.attention_kernels --sweep-decode --kv-layout hnd --page 64    # the cache's layout, block size

Each case is first checked (relative error ||out - ref|| / ||ref|| against ``TorchAttentionBackend``), then timed
with ``triton.testing.do_bench`` (median); the sweeps live in benchmarks/attention_sweeps.py and time decode
tilings as CUDA-graph replays, so small batches show the device's time, not the launches'. Decode reports GB/s
of K+V read; prefill reports causal TFLOP/s (2 matmuls x 2 flop/MAC x head_dim x visible (query, key) pairs x q
heads); store reports GB/s moved. The inputs (paged pools, metadata) come from benchmarks/attention_inputs.py.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.testing

from benchmarks.attention_inputs import (
    DTYPES,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    REF,
    TOL,
    TRI,
    decode_meta,
    make_pool,
    median_ms,
    prefill_meta,
    rel_err,
)
from benchmarks.attention_sweeps import SWEEP_CASES, sweep_decode, sweep_prefill
from benchmarks.gpu import require_cuda


def bench_decode(batch: int, lo: int, hi: int, block_size: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen, device="cuda")
    lengths = lens.tolist()
    k_cache, v_cache, table = make_pool(lengths, block_size, dtype, gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
    meta = decode_meta(lens, table, max(lengths))
    scale = HEAD_DIM**-0.5
    out = TRI.decode(q, k_cache, v_cache, meta, scale)
    err = rel_err(out, REF.decode(q, k_cache, v_cache, meta, scale))
    ms = median_ms(lambda: TRI.decode(q, k_cache, v_cache, meta, scale))
    kv_bytes = 2 * sum(lengths) * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    splits = TRI.num_decode_splits(batch, NUM_KV_HEADS, max(lengths), q.device)
    return {
        "case": f"decode B={batch} ctx {lo}..{hi} ({splits} split{'s' * (splits > 1)})",
        "err": err,
        "ms": ms,
        "rate": f"{kv_bytes / ms / 1e6:8.0f} GB/s",
        "ok": err < TOL[dtype],
    }


def bench_prefill(
    chunks: list[tuple[int, int]], block_size: int, dtype: torch.dtype, gen: torch.Generator, label: str
) -> dict:
    """chunks: (cached prefix, new tokens) per sequence."""
    kv_lens = [p + n for p, n in chunks]
    q_lens = [n for _, n in chunks]
    k_cache, v_cache, table = make_pool(kv_lens, block_size, dtype, gen)
    meta = prefill_meta(q_lens, kv_lens, table)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
    scale = HEAD_DIM**-0.5
    out = TRI.prefill(q, k_cache, v_cache, meta, scale)
    err = rel_err(out, REF.prefill(q, k_cache, v_cache, meta, scale))
    ms = median_ms(lambda: TRI.prefill(q, k_cache, v_cache, meta, scale))
    pairs = sum(n * p + n * (n + 1) // 2 for p, n in chunks)  # query j of a chunk sees p + j + 1 keys
    flops = 4 * HEAD_DIM * pairs * NUM_HEADS
    return {"case": label, "err": err, "ms": ms, "rate": f"{flops / ms / 1e9:8.1f} TFLOP/s", "ok": err < TOL[dtype]}


def bench_sdpa_baseline(seqs: int, seq_len: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """Dense causal SDPA on contiguous K/V (no paging): a yardstick for the prefill TFLOP/s."""
    q = torch.randn(seqs, NUM_HEADS, seq_len, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
    k = torch.randn(seqs, NUM_HEADS, seq_len, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = median_ms(lambda: sdpa(q, k, v, is_causal=True))
    flops = 4 * HEAD_DIM * seqs * seq_len * (seq_len + 1) // 2 * NUM_HEADS
    return {
        "case": f"torch sdpa dense causal {seqs}x{seq_len} (yardstick)",
        "err": float("nan"),
        "ms": ms,
        "rate": f"{flops / ms / 1e9:8.1f} TFLOP/s",
        "ok": True,
    }


def bench_store(num_tokens: int, block_size: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    k_cache, v_cache, _ = make_pool([num_tokens], block_size, dtype, gen)
    slots = torch.randperm(k_cache.shape[0] * block_size, device="cuda", generator=gen)[:num_tokens]
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
    v = torch.randn_like(k)
    kr, vr = k_cache.clone(), v_cache.clone()
    TRI.store_kvcache(k, v, k_cache, v_cache, slots)
    REF.store_kvcache(k, v, kr, vr, slots)
    exact = torch.equal(k_cache, kr) and torch.equal(v_cache, vr)
    ms = median_ms(lambda: TRI.store_kvcache(k, v, k_cache, v_cache, slots))
    moved = 2 * 2 * k.numel() * k.element_size()  # read k, v and write them
    return {
        "case": f"store_kvcache T={num_tokens}",
        "err": 0.0 if exact else float("inf"),
        "ms": ms,
        "rate": f"{moved / ms / 1e6:8.0f} GB/s",
        "ok": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256], help="cache block sizes to check")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="q/k/v dtype (default bf16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--sweep-decode", action="store_true", help="decode tilings x split counts")
    parser.add_argument("--sweep-prefill", action="store_true", help="prefill tilings on W1-like prompts")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="sweep cases as q_heads,batch,ctx_lo,ctx_hi[,kv_heads] (default: W1/W2-like)",
    )
    parser.add_argument(
        "--tilings",
        nargs="+",
        default=None,
        help="swept tilings as keys,warps,stages[,max registers per thread] (heads-first grids)",
    )
    parser.add_argument("--kv-layout", choices=["nhd", "hnd"], default="nhd", help="sweep: the cache's memory layout")
    parser.add_argument("--page", type=int, default=16, help="sweep: the cache's block size")
    parser.add_argument("--kv-fp8", action="store_true", help="sweep: an e4m3 cache (bf16 queries)")
    args = parser.parse_args()
    require_cuda()
    dtype = DTYPES[args.dtype]
    if args.sweep_prefill:
        return sweep_prefill(dtype, args.seed, [(16, 4, 15, 100, 1024), (16, 8, 15, 100, 1024), (32, 8, 15, 100, 1024)])
    if args.sweep_decode:
        cases = [tuple(int(x) for x in c.split(",")) for c in args.cases] if args.cases else SWEEP_CASES
        tilings = None
        if args.tilings:  # (keys, warps, stages, heads-first order, register cap if given)
            parsed = [tuple(int(x) for x in t.split(",")) for t in args.tilings]
            tilings = [(*t[:3], 1, *t[3:]) for t in parsed]
        return sweep_decode(dtype, args.seed, cases, tilings, args.kv_layout, args.page, args.kv_fp8)
    print(f"{torch.cuda.get_device_name()}  triton {triton.__version__}  torch {torch.__version__}  {args.dtype}")
    print(f"q heads {NUM_HEADS}, kv heads {NUM_KV_HEADS}, head_dim {HEAD_DIM}")

    rows: list[tuple[int, dict]] = []
    for bs in args.block_sizes:
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        rows.append((bs, bench_store(8192, bs, dtype, gen)))
        rows.append((bs, bench_decode(256, 512, 2048, bs, dtype, gen)))
        rows.append((bs, bench_decode(8, 8192, 8192, bs, dtype, gen)))  # small batch, long context: split-K
        rows.append((bs, bench_prefill([(0, 1024)] * 8, bs, dtype, gen, "prefill 8 x 1024 (fresh)")))
        rows.append((bs, bench_prefill([(3072, 1024)] * 8, bs, dtype, gen, "prefill 8 x 1024 after 3072 cached")))
        torch.cuda.empty_cache()
    rows.append((0, bench_sdpa_baseline(8, 1024, dtype, torch.Generator(device="cuda").manual_seed(args.seed))))

    print(f"\n{'page':>4}  {'case':<48} {'rel err':>9} {'median ms':>10}  {'throughput':>16}")
    for bs, r in rows:
        flag = "" if r["ok"] else "  <-- MISMATCH"
        print(f"{bs or '-':>4}  {r['case']:<48} {r['err']:9.2e} {r['ms']:10.4f}  {r['rate']:>16}{flag}")
    if not all(r["ok"] for _, r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
