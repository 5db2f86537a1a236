"""kernels/attention_flat.py: one launch attends every row of a step (prefill chunks over cached prefixes, verify
rows, decode rows) as the torch reference does, from static buffers larger than the step (as a CUDA graph replays
it): sequences past the step's count, their table rows and the tokens past its last are never read or written."""

import numpy as np
import pytest
import torch

from kernels.attention_flat import whole_step_attention, work_layout
from tests.support.oracle import rel_err
from tests.support.paged_cache import DEVICE, ON_GPU, REF, PagedCache, prefill_meta

TOL = {torch.float32: 3e-3 if ON_GPU else 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SPARE_SEQS, SPARE_TOKENS = 5, 7  # the static buffers' room past the step


def check_whole_step(chunks, num_heads, num_kv_heads, head_dim, block_size, dtype, num_programs, tiles=None) -> None:
    """chunks: (cached prefix length, new tokens) per sequence; 1 new token is a decode row; ``tiles``: (rows, keys,
    warps, stages), None for the default."""
    gen = torch.Generator().manual_seed(len(chunks) * 1000 + num_heads * 10 + head_dim + block_size)
    kv_lens = [p + n for p, n in chunks]
    q_lens = [n for _, n in chunks]
    cache = PagedCache(kv_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    cu_host, items = work_layout(np.array(q_lens), num_heads, num_kv_heads, *(tiles or ())[:1])
    n, tokens = len(chunks), int(cu_host[-1])
    qkv = torch.randn(tokens + SPARE_TOKENS, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = qkv.to(dtype).to(DEVICE)[:, :num_heads]  # a strided view of a fused projection, as the model's
    # static buffers: garbage past the step (a graph's buffers hold earlier steps' values there)
    cu = torch.full((n + 1 + SPARE_SEQS,), 10**6, dtype=torch.int32)
    cu[: n + 1] = torch.from_numpy(cu_host)
    seq_lens = torch.full((n + SPARE_SEQS,), 10**6, dtype=torch.int32)
    seq_lens[:n] = torch.tensor(kv_lens)
    tables = torch.full((n + SPARE_SEQS, cache.table.shape[1] + 4), -(10**6), dtype=torch.int32, device=DEVICE)
    tables[:n, : cache.table.shape[1]] = cache.table
    work = torch.tensor([items, n], dtype=torch.int32, device=DEVICE)
    out = torch.full((tokens + SPARE_TOKENS, num_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    whole_step_attention(
        q, cache.k, cache.v, cu.to(DEVICE), seq_lens.to(DEVICE), tables, work, head_dim**-0.5, out, n + SPARE_SEQS,
        num_programs, tiles,
    )  # fmt: skip
    ref = REF.prefill(q[:tokens], cache.k, cache.v, prefill_meta(cache, cu[: n + 1], kv_lens, q_lens), head_dim**-0.5)
    assert torch.isfinite(out[:tokens]).all(), "unwritten or NaN-contaminated outputs"
    assert torch.isnan(out[tokens:]).all(), "rows past the step's tokens were written"
    err = rel_err(out[:tokens], ref)
    assert err < TOL[dtype], f"rel err {err:.2e}"


# decode rows (a prefix + 1), a fresh prompt, chunks over prefixes aligned or not to pages and tiles, a verify row
MIXED = [(40, 1), (0, 21), (5, 3), (16, 1), (19, 30), (0, 1), (33, 4), (7, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 1), (6, 2)])  # groups 1, 2, 8 and 3 (padded to 4)
@pytest.mark.parametrize("block_size", [16, 256])
def test_a_mixed_step_matches_the_reference(dtype, heads, block_size):
    check_whole_step(MIXED, *heads, 16, block_size, dtype, num_programs=3)


@pytest.mark.parametrize("tiles", [(16, 16, 4, 1), (128, 32, 8, 2)])  # tiles of 8 and 64 tokens (group 2)
def test_other_tilings_match_when_the_host_counts_the_same_rows(tiles):
    check_whole_step(MIXED, 4, 2, 16, 16, torch.float32, num_programs=3, tiles=tiles)


def test_decode_rows_only_and_one_program():
    check_whole_step([(9, 1), (0, 1), (70, 1)], 4, 2, 16, 16, torch.float32, num_programs=1)


def test_odd_head_dim_and_more_programs_than_work():
    check_whole_step([(0, 18), (20, 5), (3, 1)], 4, 2, 24, 16, torch.float32, num_programs=64)


def test_a_step_of_no_sequences_writes_nothing():
    cache_k = torch.zeros(2, 16, 1, 16, device=DEVICE)
    q = torch.zeros(4, 2, 16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    zeros = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    work = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    whole_step_attention(q, cache_k, cache_k, zeros, zeros, zeros.view(1, 3), work, 1.0, out, 2, 4)
    assert torch.isnan(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((16, 16), 64), ((16, 2), 128), ((28, 4), 128)])
def test_a_mixed_step_matches_the_reference_gpu(dtype, block_size, heads, head_dim):
    chunks = [(0, 256), (700, 1), (513, 1), (2048, 77), (0, 1), (1000, 4)] + [(300 + 37 * i, 1) for i in range(40)]
    check_whole_step(chunks, *heads, head_dim, block_size, dtype, num_programs=264)
