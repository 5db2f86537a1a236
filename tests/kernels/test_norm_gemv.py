"""The residual add + RMSNorm inside the GEMV behind it (kernels/decode_gemm.py decode_linear_add_norm): equal to the
norm kernel followed by the GEMV, on the CPU under TRITON_INTERPRET=1 and on CUDA at the model shapes that take it,
in CUDA graphs behind a PDL kernel."""

import pytest
import torch

from kernels import fused
from kernels.decode_gemm import Tiles, decode_linear, decode_linear_add_norm, norm_gemv_tiles

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def two_launches(x, res, nw, w, tiles):
    """What ``decode_linear_add_norm`` replaces: the add + RMSNorm kernel, then the GEMV."""
    normed, summed = fused.rmsnorm(x, nw, 1e-6, res)
    return decode_linear(normed, w, tiles), summed


def captured(chain):
    """``chain`` run once (it compiles), then captured in a CUDA graph: the graph and the outputs it writes."""
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = chain()
    return graph, outputs


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_gemv_with_the_norm_inside_equals_norm_then_gemv(rows):
    # 3 rows run padded to 4; 64 output columns in 8 programs, each norming the whole row itself.
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x, res = (torch.randn(rows, 512, device=DEVICE, generator=g).to(dtype) for _ in range(2))
    w = (torch.randn(64, 512, device=DEVICE, generator=g) * 512**-0.5).to(dtype)
    nw = (torch.rand(512, device=DEVICE, generator=g) + 0.5).to(dtype)
    tiles = Tiles(8, 512, 1, 4, 1, True)
    out, summed = decode_linear_add_norm(x, res, nw, 1e-6, w, tiles)
    ref_out, ref_summed = two_launches(x, res, nw, w, tiles)
    assert torch.equal(summed, ref_summed) and torch.equal(out, ref_out)
    assert not torch.equal(out, decode_linear(x + res, w, tiles))  # the norm is applied


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(5120, 2048), (3072, 1024), (6144, 1024)])  # 30B-A3B qkv, 0.6B qkv and gate/up
@pytest.mark.parametrize("rows", [1, 2])
def test_norm_gemv_in_a_cuda_graph_equals_two_launches(n, k, rows):
    """Replayed with new inputs behind a PDL kernel that writes them: the GEMV reads x and the residual after its
    wait, and its sum and product equal the two launches' bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(n + rows)
    x0, res = (torch.randn(rows, k, device="cuda", generator=g).bfloat16() for _ in range(2))
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    nw0, nw = (torch.rand(k, device="cuda", generator=g).bfloat16() + 0.5 for _ in range(2))
    tiles = norm_gemv_tiles(x0, w)
    assert tiles is not None
    wide = torch.zeros(6144, 4096, device="cuda", dtype=torch.bfloat16)  # 8B's qkv: the norm stays apart
    assert norm_gemv_tiles(torch.zeros(rows, 4096, device="cuda", dtype=torch.bfloat16), wide) is None

    graph, (out, summed) = captured(
        lambda: decode_linear_add_norm(fused.rmsnorm(x0, nw0, 1e-6), res, nw, 1e-6, w, tiles)
    )
    for i in range(3):
        x0.copy_(torch.randn(rows, k, device="cuda", generator=g).bfloat16() * (i + 1))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_summed = two_launches(fused.rmsnorm(x0, nw0, 1e-6), res, nw, w, tiles)
        assert torch.equal(summed, ref_summed) and torch.equal(out, ref_out), f"replay {i}"
