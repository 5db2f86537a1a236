"""kernels/decode_gemm.py (split-K GEMM for decode rows) and PDL ordering (kernels/pdl.py): on the CPU under
TRITON_INTERPRET=1 at small sizes; on CUDA at the Qwen3 shapes the dispatch rule sends to it, inside CUDA graphs."""

import pytest
import torch
import torch.nn.functional as F

from kernels import fused
from kernels.decode_gemm import Tiles, decode_linear, decode_linear_tiles
from kernels.pdl import use_pdl

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("tiles", [Tiles(32, 64, 1, 4, 3), Tiles(32, 64, 2, 4, 3), Tiles(64, 64, 4, 4, 3)])
def test_decode_linear_matches_matmul(rows, tiles):
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    x = torch.randn(rows, 512, device=DEVICE, generator=g)
    w = torch.randn(128, 512, device=DEVICE, generator=g)
    out = decode_linear(x, w, tiles)
    assert out.shape == (rows, 128) and out.dtype == x.dtype
    ref = x @ w.T
    # tl.dot rounds fp32 inputs through tf32 on a GPU (10-bit mantissa): compare relative to the result's norm
    assert ((out - ref).norm() / ref.norm()).item() < (3e-3 if ON_GPU else 1e-6)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(
    "tiles", [Tiles(4, 128, 4, 4, 1, True), Tiles(8, 512, 1, 4, 1, True), Tiles(8, 64, 8, 1, 1, True)]
)
def test_gemv_matches_matmul(tiles, rows):
    """The GEMV kernel: whole weight slices of 1-8 K splits, rows padded up to a power of two (3 -> 4). 64 output
    columns: the interpreter runs the programs one by one."""
    g = torch.Generator(device=DEVICE).manual_seed(tiles[0] + rows)
    x = torch.randn(rows, 512, device=DEVICE, generator=g)
    w = torch.randn(64, 512, device=DEVICE, generator=g)
    out = decode_linear(x, w, tiles)
    ref = x @ w.T
    assert out.shape == (rows, 64) and ((out - ref).norm() / ref.norm()).item() < 1e-6


def test_dispatch_rule_stays_with_cublas_off_gpu_and_for_wide_or_tall_products():
    w = torch.zeros(1024, 2048, device=DEVICE, dtype=torch.bfloat16)
    if not ON_GPU:
        assert decode_linear_tiles(torch.zeros(1, 2048, dtype=torch.bfloat16), w) is None
        return
    assert decode_linear_tiles(torch.zeros(1, 2048, device="cuda", dtype=torch.bfloat16), w) is not None
    assert decode_linear_tiles(torch.zeros(17, 2048, device="cuda", dtype=torch.bfloat16), w) is None  # > 16 rows
    assert decode_linear_tiles(torch.zeros(1, 2048, device="cuda"), w.float()) is None  # fp32 stays exact cuBLAS
    wide = torch.zeros(6144, 1024, device="cuda", dtype=torch.bfloat16)
    assert decode_linear_tiles(torch.zeros(4, 1024, device="cuda", dtype=torch.bfloat16), wide) is None
    assert decode_linear_tiles(torch.zeros(2, 1024, device="cuda", dtype=torch.bfloat16), wide).gemv  # <= 2 rows


SHAPES = [
    *[(1024, 2048), (1024, 3072), (4096, 4096), (4096, 12288), (3072, 4096), (4096, 2048), (4096, 6144)],
    *[(4096, 1024), (6144, 1024), (6144, 4096), (24576, 4096)],  # wide: the GEMV at <= 2 rows, else cuBLAS
]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16])
def test_dispatched_shapes_match_cublas_and_repeat_exactly(n, k, rows):
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    tiles = decode_linear_tiles(x, w)
    if tiles is None:
        pytest.skip("cuBLAS serves this shape at this row count")
    out = decode_linear(x, w, tiles)
    ref = F.linear(x.float(), w.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-3
    assert torch.equal(out, decode_linear(x, w, tiles))  # partials are summed in a fixed order


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_pdl_chain_in_a_cuda_graph_reads_what_the_previous_kernel_wrote(rows):
    """rmsnorm -> GEMM (one row: the GEMV; eight: split-K) -> rmsnorm, all PDL launches, replayed with new inputs:
    a kernel that read its input before its predecessor finished would see the previous replay's values."""
    assert use_pdl(torch.zeros(1, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 2048, device="cuda", generator=g) * 2048**-0.5).bfloat16()
    nw1 = torch.rand(2048, device="cuda", generator=g).bfloat16() + 0.5
    nw2 = torch.rand(1024, device="cuda", generator=g).bfloat16() + 0.5
    tiles = decode_linear_tiles(x, w)
    assert tiles is not None and tiles.gemv == (rows == 1) and (tiles.split_k > 1 or rows == 1)

    def chain():
        return fused.rmsnorm(decode_linear(fused.rmsnorm(x, nw1, 1e-6), w, tiles), nw2, 1e-6)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for i in range(5):
        x.copy_(torch.randn(rows, 2048, device="cuda", generator=g).bfloat16() * (i + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain()), f"replay {i}"
