"""A one-row FP8 GEMV whose input the kernel in front quantized (kernels/fused.py rmsnorm_quantized,
kernels/fp8_mlp.py silu_mul_quant of a finished product): the same e4m3 values and scale as quantizing the 16-bit row,
and the same GEMV output bit for bit as the GEMV that quantizes the row itself. CPU: the Triton interpreter; ``gpu``:
Qwen3-8B's shapes in a CUDA graph behind a PDL kernel, and the model's MLP and norm paths."""

import pytest
import torch

from kernels import fp8_gemv, fp8_mlp, fused
from kernels.fp8_quant import quantize_rows
from model import fp8
from model.decoder import GatedMLP
from model.fp8 import Fp8Config
from model.fp8_linear import quantize_loaded
from model.layers import RMSNorm
from model.linear import QKVParallelLinear
from tests.support.interpreter_fp8 import fix_interpreter_fp8_rounding

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def _gpu_like_rounding():
    if not ON_GPU:
        fix_interpreter_fp8_rounding()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def gemv(x, w_q, w_s, x_scales=None):
    out = torch.empty((x.shape[0], w_q.shape[0]), dtype=torch.bfloat16, device=x.device)
    return fp8_gemv.fp8_gemv(x, w_q, w_s, None, None, out, x_scales=x_scales)


def weight(n, k, g):
    return fp8.quantize_per_channel((torch.randn(n, k, generator=g) * 0.05).to(DEVICE))


@pytest.mark.parametrize("k", [512, 300, 3000, 5000])  # 300: padding; 3,000: 2-3 steps (default_tiling); 5,000: 2
@pytest.mark.parametrize("rows", [1, 3])  # 3: each row its own scale, as cuBLASLt's products take them
def test_norm_quantizes_the_row_as_the_gemv_would(k, rows):
    g = torch.Generator().manual_seed(k)
    x, res = ((torch.randn(rows, k, generator=g) * 3).to(DEVICE).bfloat16() for _ in range(2))
    x[0, 5] = 200.0  # an outlier sets the first row's scale
    nw = (torch.rand(k, generator=g) + 0.5).to(DEVICE).bfloat16()
    x_q, x_s, summed = fused.rmsnorm_quantized(x, nw, 1e-6, res)
    normed, ref_summed = fused.rmsnorm(x, nw, 1e-6, res)
    q_ref, s_ref = quantize_rows(normed, None)
    assert torch.equal(summed, ref_summed) and same_bits(x_q, q_ref) and torch.equal(x_s, s_ref.flatten())
    assert rows == 1 or x_s[0] > 2 * x_s[1:].max()  # per-row scales, not one
    w_q, w_s = weight(48, k, g)
    out = gemv(x_q[:1], w_q, w_s, x_s[:1])
    assert torch.equal(out, gemv(normed[:1], w_q, w_s))
    ref = fp8.emulated_linear(normed[:1].float(), w_q, w_s, Fp8Config(), None)
    assert (out.float() - ref).norm() / ref.norm() < 8e-3  # float16 run sums, under bf16's output rounding


@pytest.mark.parametrize("n", [96, 3000])  # 3,000: a row wider than the interpreter's one step
def test_silu_quantizes_a_finished_product_as_the_gemv_would(n):
    g = torch.Generator().manual_seed(n)
    y = (torch.randn(1, 2 * n, generator=g) * 4).to(DEVICE).bfloat16()
    x_q, x_s = fp8_mlp.silu_mul_quant(y)
    act = fused.silu_and_mul(y)
    q_ref, s_ref = quantize_rows(act, None)
    assert same_bits(x_q, q_ref) and torch.equal(x_s, s_ref)
    w_q, w_s = weight(40, n, g)
    assert torch.equal(gemv(x_q, w_q, w_s, x_s), gemv(act, w_q, w_s))
    assert not torch.equal(gemv(x_q, w_q, w_s, x_s * 2), gemv(act, w_q, w_s))  # the scale is applied


def test_a_block_scaled_or_float32_row_is_not_taken():
    with pytest.raises(AssertionError):
        w_q, w_s = fp8.quantize_blocks(torch.randn(128, 256).to(DEVICE), (128, 128))
        x_q, x_s = quantize_rows(torch.randn(1, 256, device=DEVICE).bfloat16(), None)
        fp8_gemv.fp8_gemv(x_q, w_q, w_s, (128, 128), None, torch.empty(1, 128, device=DEVICE), x_scales=x_s)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_quantized_rows_in_a_cuda_graph_equal_the_gemv_quantizing_itself():
    """Qwen3-8B's gate/up behind its norm and its down behind the SiLU, replayed with new inputs written by a PDL
    kernel in front: bit for bit the unquantized chain."""
    g = torch.Generator().manual_seed(8)
    w_gu, s_gu = weight(24576, 4096, g)
    w_d, s_d = weight(4096, 12288, g)
    x0, res = (torch.randn(1, 4096, generator=g).to(DEVICE).bfloat16() for _ in range(2))
    nw0, nw = ((torch.rand(4096, generator=g) + 0.5).to(DEVICE).bfloat16() for _ in range(2))

    def chain():
        x_q, x_s, summed = fused.rmsnorm_quantized(fused.rmsnorm(x0, nw0, 1e-6), nw, 1e-6, res)
        gate_up = gemv(x_q, w_gu, s_gu, x_s)
        a_q, a_s = fp8_mlp.silu_mul_quant(gate_up)
        return gemv(a_q, w_d, s_d, a_s), summed

    def reference():
        normed, summed = fused.rmsnorm(fused.rmsnorm(x0, nw0, 1e-6), nw, 1e-6, res)
        return gemv(fused.silu_and_mul(gemv(normed, w_gu, s_gu)), w_d, s_d), summed

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = chain()
    for i in range(3):
        x0.copy_(torch.randn(1, 4096, generator=g).to(DEVICE).bfloat16() * (i + 1))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_summed = reference()
        assert torch.equal(summed, ref_summed) and torch.equal(out, ref), f"replay {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 2, 64, 300])  # 1: the GEMVs; 2+: cuBLASLt, scalar scales up to 256 rows
def test_the_mlp_and_qkv_paths_take_quantized_rows_and_match_the_plain_layers(rows):
    torch.manual_seed(rows)
    mlp = GatedMLP(1024, 3072).cuda().bfloat16()
    qkv = QKVParallelLinear(1024, 128, 16, 8).cuda().bfloat16()
    holder = torch.nn.ModuleList([mlp, qkv])
    for p in holder.parameters():
        p.data.normal_(0, 0.05)
    quantize_loaded(holder, Fp8Config(block=None))
    norm = RMSNorm(1024, 1e-6).cuda().bfloat16()
    x, res = torch.randn(2, rows, 1024, device="cuda").bfloat16()
    quant = mlp.down_proj.quant
    if rows == 1:
        assert quant.quantizes_row_before(mlp.down_proj, torch.empty(1, 3072, device="cuda").bfloat16())
    else:  # the norm quantizes for gate/up and qkv; the fused MLP middle quantizes for down
        assert quant.norm_quantizes_rows(mlp.gate_up_proj, x) and quant.norm_quantizes_rows(qkv, x)
        assert quant.gated_mlp_applies(mlp.gate_up_proj, mlp.down_proj, x)
    out, summed = mlp.norm_and_forward(norm, x, res)
    normed, ref_summed = norm(x, res)
    assert torch.equal(summed, ref_summed)
    # one row: the GEMVs quantizing their rows themselves; more: the fused MLP quantizing the normed rows itself
    assert torch.equal(out, mlp.down_proj(mlp.act(mlp.gate_up_proj(normed))) if rows == 1 else mlp(normed))
    y, _ = qkv.norm_and_forward(norm, x, res)
    assert torch.equal(y, qkv(normed))
