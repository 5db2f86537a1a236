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


_PREFILL_ROWS = pytest.param(  # prefill's row count, at Qwen3-8B's width
    1100, 12288, marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA")]
)


def middle(m, n, bias):
    gen = torch.Generator().manual_seed(m * n)
    y = (torch.randn(m, 2 * n, generator=gen) * 300).to(torch.bfloat16).to(DEVICE)
    y[-1] = 0  # an all-zero row: the smallest scale, zeros out
    x_s = (torch.rand(m, 1, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    w_s = (torch.rand(2 * n, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    b = (torch.randn(2 * n, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE) if bias else None
    return y, x_s, w_s, b


@pytest.mark.parametrize("bias", [False, True])
# CPU: 96 and 300 columns as a power of two and a rest, 2,100 as 2,048 + 64, 5,000 in two passes of 2,048 steps
@pytest.mark.parametrize("m,n", [(2, 96), (3, 300), (2, 2100), (2, 5000), _PREFILL_ROWS])
def test_silu_mul_quant_equals_the_unfused_kernels(m, n, bias):
    y, x_s, w_s, b = middle(m, n, bias)
    q, s = fp8_mlp.silu_mul_quant(y, x_s, w_s, b)
    q_ref, s_ref = unfused(y, x_s, w_s, b)
    assert q.shape == (m, n) and s.shape == (m, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    if b is None:  # the all-zero row quantizes to zeros
        assert not q[-1].float().any()


@pytest.mark.parametrize(
    "tiling",
    [fp8_mlp.whole_row(300, 2, 2), fp8_mlp.whole_row(300, 4, 4), fp8_mlp.Tiling(128, 0, 2, 2)],
    ids=["whole-2-rows", "whole-4-rows", "steps-2-rows"],
)
def test_several_rows_a_program_give_each_row_its_own_scale(tiling):
    """5 rows over programs of 2 or 4 (the last one short): every row's bits as the engine's one-row programs."""
    y, x_s, w_s, b = middle(5, 300, True)
    y[1] *= 40  # one row's scale far above the others'
    q_ref, s_ref = fp8_mlp.silu_mul_quant(y, x_s, w_s, b)
    q = torch.full_like(q_ref, 1.0)
    s = torch.zeros_like(s_ref)
    fp8_mlp.launch(y, x_s, w_s, b, q, s, tiling)
    assert s[1] > 10 * s[0] and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


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
