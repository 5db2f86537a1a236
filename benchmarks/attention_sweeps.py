"""Tiling sweeps of the Triton attention kernels, run through benchmarks/attention_kernels.py
(``--sweep-decode``, ``--sweep-prefill``): decode tilings x split counts timed as CUDA-graph replays of ten calls
(the device's time, as the decode graphs run them, not the host's launch time; a cache smaller than the L2 stays
in it across the ten calls, where a step's other layers would evict it), prefill tilings timed eagerly."""

from __future__ import annotations

import functools
import itertools

import torch

from benchmarks.attention_inputs import (
    HEAD_DIM,
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
from kernels.attention import copy_to_value_cache
from kernels.graph_timing import graph_replay_us
from kernels.triton_attention import TritonAttentionBackend

GRAPH_CALLS = 10


def graph_ms(call) -> float:
    """Milliseconds per call of ``call``, GRAPH_CALLS of them captured back to back in one CUDA graph."""

    def run():
        for _ in range(GRAPH_CALLS):
            call()

    return graph_replay_us(run, GRAPH_CALLS, replays=20) / 1e3


SWEEP_CASES = [  # (q heads, batch, ctx lo, ctx hi)
    (16, 256, 100, 1024),
    (16, 256, 1000, 2000),
    (16, 64, 1000, 2000),
    (16, 16, 1500, 2000),
    (32, 256, 300, 1500),
    (32, 1, 600, 600),
]


def sweep_decode(
    dtype: torch.dtype,
    seed: int,
    cases: list[tuple[int, ...]],
    tilings: list[tuple[int, ...]] | None = None,
    layout: str = "nhd",
    page: int = 16,
    kv_fp8: bool = False,
) -> None:
    """Time decode tilings (keys per tile, warps, stages) and split counts on the batches W1 and W2 produce, for
    the Qwen3-0.6B (16 q / 8 kv heads) and Qwen3-8B (32 / 8) head layouts; prints the best per case. ``layout``
    and ``page``: the cache's memory layout (see make_pool) and block size; ``kv_fp8``: an e4m3 cache."""
    if tilings is None:
        tilings = [(bn, w, st, order) for bn, w, st in ((64, 4, 2), (128, 4, 2), (128, 4, 3)) for order in (0, 1)]
    for case in cases:
        heads, batch, lo, hi, *kv_heads = case
        _sweep_case(heads, batch, lo, hi, dtype, seed, tilings, *kv_heads, layout=layout, page=page, kv_fp8=kv_fp8)
        torch.cuda.empty_cache()


def _sweep_case(
    heads, batch, lo, hi, dtype, seed, tilings, kv_heads=NUM_KV_HEADS, layout="nhd", page=16, kv_fp8=False
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen, device="cuda")
    k_cache, v_cache, table = make_pool(lens.tolist(), page, dtype, gen, kv_heads, layout)
    if kv_fp8:  # the same values as the engine's e4m3 cache stores them (scale 1; V keys-contiguous unless hnd)
        k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
        v_cache = copy_to_value_cache(v_cache) if layout == "nhd" else v_cache
    q = torch.randn(batch, heads, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
    meta = decode_meta(lens, table, 4096)  # max_model_len, as the CUDA graphs are captured
    ref = REF.decode(q, k_cache, v_cache, meta, 1.0)
    kv_bytes = 2 * int(lens.sum()) * kv_heads * HEAD_DIM * k_cache.element_size()
    default = functools.partial(TRI.decode, q, k_cache, v_cache, meta, 1.0)
    default_ms = graph_ms(default)
    policy = TRI.num_decode_splits(batch, kv_heads, 4096, q.device, fp8_cache=kv_fp8)
    all_splits = sorted({1, 2, 4, 8, 16, policy})
    best, grid = (default_ms, None), {}
    for tiles in tilings:
        be = TritonAttentionBackend(decode_tiles=(*tiles[:3], *tiles[4:]), decode_heads_first=bool(tiles[3]))
        for splits in all_splits:
            if batch * kv_heads * splits > 64 * 132:
                continue
            run = functools.partial(be.decode, q, k_cache, v_cache, meta, 1.0, num_splits=splits)
            try:
                err = rel_err(run(), ref)
            except Exception as e:  # e.g. out of shared memory for the deepest pipelines
                print(f"  {tiles} splits {splits}: {type(e).__name__}")
                continue
            if err > TOL[dtype]:
                print(f"  {tiles} splits {splits}: MISMATCH {err:.2e}")
                continue
            grid[tiles, splits] = ms = graph_ms(run)
            if ms < best[0]:
                best = (ms, (*tiles, splits))
    again_ms = graph_ms(default)  # the default timed again last: the first timing is not a warm-up artefact
    print(
        f"\n{heads:5d} q /{kv_heads} kv heads, {layout} pages of {page}{', e4m3' * kv_fp8}, batch {batch:5d}, "
        f"context {lo}..{hi}: "
        f"default {default_ms:.4f} ms "
        f"(again {again_ms:.4f}) {kv_bytes / default_ms / 1e6:5.0f} GB/s, policy splits {policy}; best {best[0]:.4f} "
        f"{kv_bytes / best[0] / 1e6:5.0f} GB/s {best[1]}"
    )
    print(f"  {'tiles':>14s} " + " ".join(f"{f'x{s}':>7s}" for s in all_splits))
    for tiles in tilings:
        print(f"  {str(tiles):>14s} " + " ".join(f"{grid.get((tiles, s), float('nan')):7.4f}" for s in all_splits))


def sweep_prefill(dtype: torch.dtype, seed: int, cases: list[tuple[int, ...]]) -> None:
    """Time prefill tilings (queries per tile, keys per tile, warps, stages) on W1-like fresh prompts: per case
    (q heads, kv heads, sequences, length lo, hi), the default and every tiling, causal TFLOP/s."""
    for heads, kv_heads, seqs, lo, hi in cases:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q_lens = torch.randint(lo, hi + 1, (seqs,), generator=gen, device="cuda").tolist()
        k_cache, v_cache, table = make_pool(q_lens, 16, dtype, gen, kv_heads)
        num_tokens = sum(q_lens)
        q = torch.randn(num_tokens, heads, HEAD_DIM, dtype=dtype, device="cuda", generator=gen)
        meta = prefill_meta(q_lens, q_lens, table)
        scale = HEAD_DIM**-0.5
        ref = REF.prefill(q, k_cache, v_cache, meta, scale)
        flops = 4 * HEAD_DIM * heads * sum(n * (n + 1) // 2 for n in q_lens)
        results = {"default": median_ms(functools.partial(TRI.prefill, q, k_cache, v_cache, meta, scale))}
        for tiles in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)):
            be = TritonAttentionBackend(prefill_tiles=tiles)
            try:
                err = rel_err(be.prefill(q, k_cache, v_cache, meta, scale), ref)
            except Exception as e:  # out of shared memory / registers
                results[tiles] = f"{type(e).__name__}"
                continue
            results[tiles] = median_ms(functools.partial(be.prefill, q, k_cache, v_cache, meta, scale), rep=60)
            if err > TOL[dtype]:
                results[tiles] = "MISMATCH"
        timed = {k: v for k, v in results.items() if isinstance(v, float)}
        print(f"\n{heads} q / {kv_heads} kv heads, {seqs} fresh prompts of {lo}..{hi} ({num_tokens} tokens):")
        for k, v in sorted(timed.items(), key=lambda kv: kv[1])[:6] + [("default", results["default"])]:
            print(f"  {str(k):>20s} {v:8.4f} ms {flops / v / 1e9:7.1f} TFLOP/s")
