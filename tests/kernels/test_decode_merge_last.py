"""NANOSERVE_DECODE_MERGE_LAST=1: in the few-sequence regime the last split program of each (sequence, kv head)
merges the splits itself, instead of a second launch. Same results as the torch reference, and the arrival counters
are zero again after every launch (the next layer, or the next graph replay, starts from them)."""

import pytest
import torch

from kernels.attention import AttentionMetadata
from kernels.triton_attention import TritonAttentionBackend
from tests.kernels.test_triton_kernels import GPU_DTYPES, TOL, check_decode, gpu, needs_cuda
from tests.support.oracle import rel_err
from tests.support.paged_cache import DEVICE, REF, PagedCache


@pytest.fixture
def backend(monkeypatch) -> TritonAttentionBackend:
    monkeypatch.setenv("NANOSERVE_DECODE_MERGE_LAST", "1")
    be = TritonAttentionBackend()
    assert be.merge_last
    return be


def tickets_zero(be: TritonAttentionBackend) -> bool:
    return all(bool((t == 0).all()) for t in be._tickets.values()) and len(be._tickets) == 1


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_merge_last_matches_reference(backend, num_splits):
    # padding rows (0), splits left empty (8 splits over 3 keys) and GQA 4:1 in one batch
    for _ in range(2):  # twice: the counters must have been reset by the first launch
        check_decode([1, 17, 0, 40, 16, 5, 3], 8, 2, 16, 16, torch.float32, num_splits, backend=backend)
        assert tickets_zero(backend)


def test_merge_last_sequence_major_grid(monkeypatch):
    monkeypatch.setenv("NANOSERVE_DECODE_MERGE_LAST", "1")
    be = TritonAttentionBackend(decode_heads_first=False)
    check_decode([9, 0, 40], 4, 2, 24, 16, torch.float32, num_splits=3, backend=be)
    assert tickets_zero(be)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("heads", [(32, 4), (32, 8), (16, 2)])
def test_merge_last_gpu(backend, dtype, heads):
    gen = torch.Generator().manual_seed(3)
    for batch in (1, 2, 7):
        lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
        for _ in range(3):  # racing programs: repeat so a missed release or acquire has a chance to show
            check_decode(lens, *heads, 128, 16, dtype, num_splits=None, backend=backend)
        assert tickets_zero(backend)


@gpu
@needs_cuda
def test_merge_last_cuda_graph(backend):
    """Captured with 8 splits, replayed at other lengths: every replay merges and leaves the counters at zero."""
    batch, hq, hkv, d = 2, 32, 4, 128
    gen = torch.Generator().manual_seed(4)
    cache = PagedCache([2048] * batch, hkv, d, 16, torch.bfloat16, gen)
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
    backend.decode(q, k, v, meta, 0.1, out=out, num_splits=8)  # compiles and makes the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.decode(q, k, v, meta, 0.1, out=out, num_splits=8)
    for new in ([1, 2048], [700, 33], [2048, 1500]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, REF.decode(q, k, v, meta, 0.1)) < TOL[torch.bfloat16]
        assert tickets_zero(backend)
