"""kernels/fp8_mlp.py: the fused scales + SiLU-and-mul + quantization kernel gives the same bits as the three
kernels it replaces (CPU: the Triton interpreter; ``gpu``: an H200), and the fused FP8 MLP equals the unfused layers
(bit for bit where both take scalar-scaled gate/up products, to bf16 rounding above 128 rows)."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_gemm, fp8_mlp, fp8_rescale, fused, scaled_mm
from kernels.fp8_quant import quantize_rows
from model import fp8
from tests.support.interpreter_fp8 import fix_interpreter_fp8_rounding

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(autouse=True)
def _gpu_like_rounding():
    if not ON_GPU:
        fix_interpreter_fp8_rounding()


def unfused(y, x_s, w_s, bias):
    """What the MLP ran before: the rescale in place, SiLU-and-mul, the down input's quantization."""
    scaled = fp8_rescale.rescale_(y.clone(), x_s, w_s, bias)
    return quantize_rows(fused.silu_and_mul(scaled), None)


_PREFILL_ROWS = pytest.param(  # prefill's tiling (two passes over slices), at Qwen3-8B's width
    1100, 12288, marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA")]
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n", [(2, 96), (3, 300), (2, 2100), _PREFILL_ROWS])  # 2,100 columns: two steps (CPU)
def test_silu_mul_quant_equals_the_unfused_kernels(m, n, bias):
    gen = torch.Generator().manual_seed(m * n)
    y = (torch.randn(m, 2 * n, generator=gen) * 300).to(torch.bfloat16).to(DEVICE)
    y[-1] = 0  # an all-zero row: the smallest scale, zeros out
    x_s = (torch.rand(m, 1, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    w_s = (torch.rand(2 * n, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    b = (torch.randn(2 * n, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE) if bias else None
    q, s = fp8_mlp.silu_mul_quant(y, x_s, w_s, b)
    q_ref, s_ref = unfused(y, x_s, w_s, b)
    assert q.shape == (m, n) and s.shape == (m, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    if b is None:  # the all-zero row quantizes to zeros
        assert not q[-1].float().any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("m", [2, 16, 128, 200, 256])
def test_fp8_gated_mlp_equals_the_unfused_layers(m):
    gen = torch.Generator().manual_seed(m)
    hidden, inter = 1024, 3072
    x = torch.randn(m, hidden, generator=gen).to(torch.bfloat16).cuda()
    w_gu, s_gu = fp8.quantize_per_channel((torch.randn(2 * inter, hidden, generator=gen) * 0.05).cuda())
    w_d, s_d = fp8.quantize_per_channel((torch.randn(hidden, inter, generator=gen) * 0.05).cuda())
    scaled_mm.probe_scaled_mm(x.device)
    assert fp8_mlp.applies(m, w_gu, w_d)
    out = fp8_mlp.fp8_gated_mlp(x, (w_gu, s_gu, None), (w_d, s_d, None))
    act = fused.silu_and_mul(fp8_gemm.fp8_linear(x, w_gu, s_gu, None))
    ref = fp8_gemm.fp8_linear(act, w_d, s_d, None)
    if fp8_rescale.applies(m):  # both take the scalar-scaled gate/up product: the same bits
        assert torch.equal(out, ref)
    else:  # the unfused gate/up takes rowwise scales: a bf16 ulp apart, which moves some e4m3 roundings of the act
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 3e-2, err
