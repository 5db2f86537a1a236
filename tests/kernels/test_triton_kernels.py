"""Triton attention kernels vs the torch reference backend.

On CUDA the cases run at realistic sizes (``gpu`` marker) and tiny ones; on the CPU only the tiny cases run,
through the Triton interpreter.
"""

import dataclasses
import math

import pytest
import torch

from kernels.attention import AttentionMetadata
from kernels.triton_attention import TritonAttentionBackend
from tests.support.oracle import rel_err
from tests.support.paged_cache import DEVICE, ON_GPU, REF, TRI, PagedCache, decode_backend, prefill_meta

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")

# The interpreter computes in numpy (fp32 exact-ish); on GPU fp32 dots run in tf32.
TOL = {torch.float32: 3e-3 if ON_GPU else 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPES = GPU_DTYPES if ON_GPU else CPU_DTYPES

# ----------------------------------------------------------------------------------------------------------------------
# store_kvcache
# ----------------------------------------------------------------------------------------------------------------------


def check_store(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, dtype, slot_dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks = math.ceil(num_tokens / block_size) + 2
    total = num_blocks * block_size
    slots = torch.randperm(total, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding tokens
    slots = slots.to(slot_dtype).to(DEVICE)
    # k/v as strided views of a fused qkv projection, like the model produces them.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc, vc = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()
    TRI.store_kvcache(k, v, kc, vc, slots)
    REF.store_kvcache(k, v, kr, vr, slots)
    # Exact: written slots match, skipped ones are still NaN.
    torch.testing.assert_close(kc, kr, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc, vr, rtol=0, atol=0, equal_nan=True)
    assert (~torch.isnan(kc)).sum().item() == (slots >= 0).sum().item() * num_kv_heads * head_dim


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [16, 256])
def test_store_kvcache_small(dtype, slot_dtype, block_size):
    check_store(37, 2, 16, block_size, dtype, slot_dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
def test_store_kvcache_gpu(dtype, block_size):
    check_store(8192, 8, 128, block_size, dtype, torch.int64)
    check_store(1000, 2, 64, block_size, dtype, torch.int32)


# ----------------------------------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------------------------------


def check_prefill(
    chunks: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
) -> None:
    """chunks: (cached prefix length, new tokens) per sequence."""
    gen = torch.Generator().manual_seed(len(chunks) * 1000 + num_heads + head_dim + block_size)
    kv_lens = [p + n for p, n in chunks]
    q_lens = [n for _, n in chunks]
    cache = PagedCache(kv_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    num_tokens = int(cu[-1])
    # q as a strided view of a fused qkv projection.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, :num_heads]
    meta = prefill_meta(cache, cu, kv_lens, q_lens)
    scale = head_dim**-0.5
    out = torch.full((num_tokens, num_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    TRI.prefill(q, cache.k, cache.v, meta, scale, out=out)
    ref = REF.prefill(q, cache.k, cache.v, meta, scale)
    assert torch.isfinite(out).all(), "unwritten or NaN-contaminated outputs"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err:.2e}"
    # The default path (backend allocates the output) agrees too.
    torch.testing.assert_close(TRI.prefill(q, cache.k, cache.v, meta, scale), out, rtol=0, atol=0)


GQA_SMALL = [(2, 2), (4, 2), (8, 1)]  # (q heads, kv heads): ratios 1, 2, 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA_SMALL)
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_small(dtype, heads, block_size):
    # Fresh prompts, a 1-token chunk, chunks continuing from cached prefixes (aligned or not to blocks/tiles).
    chunks = [(0, 1), (0, 21), (5, 3), (16, 1), (19, 30)]
    check_prefill(chunks, *heads, 16, block_size, dtype)


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_small_head32(block_size):
    check_prefill([(0, 18), (34, 1), (3, 17)], 4, 1, 32, block_size, torch.float32)


def test_prefill_small_odd_head_dim():
    # head_dim not a power of two: padded tile with masked lanes.
    check_prefill([(0, 18), (20, 5)], 4, 2, 24, 16, torch.float32)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((16, 16), 64), ((16, 2), 128)])
def test_prefill_gpu(dtype, block_size, heads, head_dim):
    chunks = [(0, 1024), (0, 1), (700, 324), (2048, 77), (513, 1), (0, 333), (1000, 1500)]
    check_prefill(chunks, *heads, head_dim, block_size, dtype)


# ----------------------------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------------------------


def check_decode(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype,
    num_splits: int | None,
    garbage_table: bool = False,
    backend: TritonAttentionBackend = TRI,
    head_major: bool = False,
) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + num_heads + block_size)
    cache = PagedCache(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen, extra_cols=5)
    table = cache.table
    if garbage_table:
        # Entries past seq_len are never read, so even out-of-range ids must be harmless.
        need = torch.tensor([math.ceil(n / block_size) for n in seq_lens], device=DEVICE)
        cols = torch.arange(table.shape[1], device=DEVICE)
        table = torch.where(cols[None, :] < need[:, None], table, torch.full_like(table, 2**30))
    batch = len(seq_lens)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEVICE),
        num_prefill_tokens=0,
        num_prefills=0,
        num_decodes=batch,
        decode_seq_lens=lens,
        decode_block_tables=table,
        max_decode_seq_len=max(seq_lens),
    )
    scale = head_dim**-0.5
    guarded = torch.full((batch + 1, num_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    out = guarded[:batch]  # the row past it must stay unwritten
    k, v = cache.k, cache.v
    if head_major:  # the same values, each head's slice of a block contiguous in memory (a strided view)
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    backend.decode(q, k, v, meta, scale, out=out, num_splits=num_splits)
    assert torch.isfinite(out).all(), "unwritten or NaN-contaminated outputs"
    assert guarded[batch].isnan().all(), "a program wrote past the last sequence's heads"
    live = lens > 0
    assert (out[~live] == 0).all(), "padding rows (seq_len 0) must be zeros"
    ref_meta = dataclasses.replace(meta, decode_block_tables=cache.ref_table)
    ref = REF.decode(q, *cache.clean(), ref_meta, scale)
    err = rel_err(out[live], ref[live])
    assert err < TOL[dtype], f"rel err {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA_SMALL)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("keys_m", [True, False], ids=["keys-m", "heads-m"])
def test_decode_small(dtype, heads, block_size, num_splits, keys_m):
    # 0 = padded batch row; 1, block multiples and ragged lengths. Both layouts of stage 1 (one-warp tiles take the
    # keys as M, 4-warp ones the query group).
    backend = decode_backend(keys_m)
    check_decode([1, 17, 0, 40, 16, 5], *heads, 16, block_size, dtype, num_splits, backend=backend)


def test_decode_small_many_splits_head32():
    # More splits than tiles: most splits are empty and must drop out of the merge.
    check_decode([3, 50, 0, 33], 8, 2, 32, 16, torch.float32, num_splits=8)


def test_decode_small_merge_past_the_last_head():
    # 12 query heads over 3 splits: the merge's programs take 8 heads each, the second 4 of them past the end.
    check_decode([3, 50, 0, 33], 12, 4, 32, 16, torch.float32, num_splits=3)


def test_decode_small_odd_head_dim():
    check_decode([9, 0, 40], 4, 2, 24, 16, torch.float32, num_splits=2)


def test_store_kvcache_odd_shapes():
    check_store(11, 3, 24, 16, torch.float32, torch.int64)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_small_head_major_cache(num_splits):
    # The kernels read the cache through its strides: a head-major block layout (benchmarks' --kv-layout hnd)
    # gives the same result.
    check_decode([1, 17, 0, 40, 16, 5], 8, 2, 16, 16, torch.float32, num_splits, head_major=True)


def test_decode_small_garbage_table():
    check_decode([7, 0, 30, 16], 4, 2, 16, 16, torch.float32, num_splits=2, garbage_table=True)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_small_sequence_major_grid(num_splits):
    # The grid order is a layout choice only: (batch, heads, splits) gives the same result as heads first.
    be = TritonAttentionBackend(decode_heads_first=False)
    check_decode([1, 17, 0, 40, 16, 5], 8, 2, 16, 16, torch.float32, num_splits, backend=be)


def test_decode_split_policy(monkeypatch):
    # Host-only: depends on batch, kv heads, the SM count (an H200's here) and the host max length; honours the cap.
    monkeypatch.setattr("kernels.triton_attention.num_sms", lambda device, cpu: 132)
    be = TritonAttentionBackend(max_splits=8, min_split_tokens=256)
    dev = torch.device("cuda") if ON_GPU else torch.device("cpu")
    assert be.num_decode_splits(1, 1, 100_000, dev) <= 8
    assert be.num_decode_splits(1, 1, 10, dev) == 1
    assert be.num_decode_splits(4096, 8, 100_000, dev) == 1
    # the mid regime: a power of two, at least 2, and more splits for fewer sequences
    mid = [be.num_decode_splits(b, 8, 100_000, dev) for b in (16, 32, 64, 128)]
    assert all(m >= 2 and m & (m - 1) == 0 for m in mid) and mid == sorted(mid, reverse=True)
    assert mid == [8, 8, 8, 4]  # 16 and 32 sequences want more than max_splits
    assert be.num_decode_splits(TritonAttentionBackend.DIRECT_PROGRAMS_PER_SM * 132 // 8, 8, 100_000, dev) == 1
    # an e4m3 cache: one-warp programs split to one wave from the mid regime up (max_splits 8 caps 16
    # sequences), to ~4 waves where one split fills a wave; the same as 16-bit caches below the mid regime
    fp8 = [be.num_decode_splits(b, 8, 100_000, dev, fp8_cache=True) for b in (2, 16, 64, 128, 256, 512, 1024)]
    assert fp8 == [be.num_decode_splits(2, 8, 100_000, dev), 8, 4, 2, 4, 2, 1]
    assert be.num_decode_splits(256, 8, 300, dev, fp8_cache=True) == 2  # still capped by length


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((16, 16), 64), ((16, 2), 128)])
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_decode_gpu(dtype, block_size, heads, head_dim, num_splits):
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 2049, (61,), generator=gen).tolist() + [0, 0, 1]
    check_decode(lens, *heads, head_dim, block_size, dtype, num_splits)


@gpu
@needs_cuda
def test_decode_gpu_garbage_table_and_small_batch():
    check_decode([4000, 1, 0, 257], 32, 8, 128, 16, torch.bfloat16, num_splits=None, garbage_table=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_gpu_two_sequences_head64_gqa4(num_splits):
    # The attention shape of the bf16 MoE test's checkpoint, whose decode row of a 600-token context differs from
    # HF's (docs/PERFORMANCE_LOG.md log 31a): 64-key split programs, a query group of 4 padded to 16 rows.
    check_decode([600, 34], 8, 2, 64, 16, torch.bfloat16, num_splits)


@gpu
@needs_cuda
def test_decode_cuda_graph():
    """Captured once, replayed with other lengths: the launch must not depend on device data."""
    batch, hq, hkv, d, bs = 8, 32, 8, 128, 16
    gen = torch.Generator().manual_seed(2)
    cache = PagedCache([2048] * batch, hkv, d, bs, torch.bfloat16, gen)
    k, v = cache.clean()
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    lens = torch.full((batch,), 2048, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEVICE),
        num_prefill_tokens=0,
        num_prefills=0,
        num_decodes=batch,
        decode_seq_lens=lens,
        decode_block_tables=cache.ref_table,
        max_decode_seq_len=2048,
    )
    out = torch.empty_like(q)
    TRI.decode(q, k, v, meta, 0.1, out=out)  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        TRI.decode(q, k, v, meta, 0.1, out=out)
    lens.copy_(torch.tensor([1, 0, 100, 2048, 17, 512, 1000, 3], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = REF.decode(q, k, v, meta, 0.1)
    live = lens > 0
    assert rel_err(out[live], ref[live]) < TOL[torch.bfloat16]
    assert (out[~live] == 0).all()


def test_warmup_compiles_every_decode_variant_without_error():
    backend = TritonAttentionBackend(max_splits=4)
    if not ON_GPU:  # the interpreter runs every program: 4 rows instead of 64 take the same code paths
        backend.MID_MIN_PROGRAMS = 8
    k_cache = torch.randn(4, 16, 2, 16, device=DEVICE)
    v_cache = torch.randn(4, 16, 2, 16, device=DEVICE)
    backend.warmup(k_cache, v_cache, num_heads=4, dtype=torch.float32)  # splits 1, 2, 4


def test_kernel_regs_counts_an_sm90_build_without_a_gpu():
    # tests/support/decode_regs.py: a real sm_90a build and ptxas report on the CPU (a compiler run, so outside the
    # interpreter this suite sets): both split-decode variants get plausible registers, shared memory and an
    # occupancy that follows from them.
    import os
    import subprocess
    import sys

    from tests.support.processes import ROOT

    root = str(ROOT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": root}
    cmd = [sys.executable, "-m", "tests.support.decode_regs", "--tiles", "64,4,2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("split decode")]
    assert len(rows) == 2, out
    for *_, tiles, regs, _spill, smem, per_sm in rows:
        regs, smem, per_sm = int(regs), float(smem), int(per_sm)
        assert tiles == "64,4,2" and 32 <= regs <= 255 and smem > 0
        assert per_sm == min(65536 // (-(-regs * 32 // 256) * 256 * 4), int(228 // (smem + 1)), 16)
    # the one-warp tiles an e4m3 cache takes (TritonAttentionBackend.ONE_WARP_TILES): the register cap holds
    # without spills, so 16 programs (warps) share an SM
    tiles = ",".join(map(str, TritonAttentionBackend.ONE_WARP_TILES))
    cmd[-2:] = ["--kv-fp8", "--tiles", tiles]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split()[-5:] for line in out.splitlines() if line.startswith("split decode")]
    assert rows == [[tiles, "128", "0", rows[0][3], "16"]] * 2, out
    # the kernel the engine runs on those tiles takes the keys as M: within the cap too, no spills
    out = subprocess.run([*cmd, "--keys-m"], env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split()[-5:] for line in out.splitlines() if line.startswith("split decode")]
    assert len(rows) == 2 and all(int(r[1]) <= 128 and r[2] == "0" and int(r[4]) >= 16 for r in rows), out
