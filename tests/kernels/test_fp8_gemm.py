"""kernels/fp8_quant.py, fp8_gemv.py, fp8_gemm.py, scaled_mm.py and fp8_rescale.py: the activation quantization
kernel computes model/fp8.py's scales and e4m3 values exactly; the FP8 GEMV, our Triton GEMM and torch._scaled_mm
(rowwise, or scalar scales and the rescale; where the device runs it) equal the float32 emulation up to the sum's
rounding. CPU: tiny shapes in the Triton interpreter; CUDA (``gpu``): Qwen3-8B's layer shapes and CUDA graphs. The
engine's FP8 logits: tests/engine/test_fp8_engine_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import fp8_gemm, fp8_gemv, fp8_rescale, scaled_mm
from kernels.fp8_quant import quantize_rows
from model import fp8
from tests.support.interpreter_fp8 import fix_interpreter_fp8_rounding
from tests.support.processes import ROOT

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
# float32 sums of exact e4m3 products: only the order differs from the emulation's
FMA_TOL = 1e-5
# Hopper's FP8 tensor cores add in reduced precision (the interpreter in float32), so a GEMM on a GPU gets more slack
TC_TOL = 1e-3 if ON_GPU else 1e-5


@pytest.fixture(autouse=True)
def _gpu_like_rounding():
    if not ON_GPU:
        fix_interpreter_fp8_rounding()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def weights(n: int, k: int, block, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE)
    w_q, w_s = fp8.quantize_per_channel(w) if block is None else fp8.quantize_blocks(w, block)
    return w, w_q, w_s


@pytest.mark.parametrize("group", [None, 32, 128])
@pytest.mark.parametrize("m,k", [(1, 96), (5, 300), (3, 512)])
def test_quantize_rows_equals_the_reference(group, m, k):
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * 30).to(DEVICE)
    x[0, : k // 2] = 0  # an all-zero group: the smallest scale, zeros out
    q, s = quantize_rows(x, group)
    q_ref, s_ref = fp8.quantize_activations(x, group)
    assert s.shape == s_ref.shape and s.stride(0) == 1  # rows are the unit-stride dim (cuBLASLt's block scales)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


CPU_CASES = [
    # m, n, k, block: decode-sized (split over K on 4 "SMs": the reduce pass runs), prefill-sized, partial tiles
    (1, 32, 2048, None),
    (3, 64, 256, (32, 64)),
    (2, 40, 1024, (32, 128)),
    (20, 48, 160, (16, 32)),
    (18, 64, 256, None),
]


@pytest.mark.parametrize("m,n,k,block", CPU_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_fp8_gemm_equals_emulation(m, n, k, block, bias):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE) * 5
    x[-1, : k // 3] = 0
    _, w_q, w_s = weights(n, k, block, gen)
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    x_q, x_s = quantize_rows(x, None if block is None else block[1])
    out = torch.full((m, n), float("nan"), device=DEVICE)
    fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, block, b, out)
    ref = fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config(block=block), b)
    assert out.isfinite().all()
    assert rel(out, ref) < TC_TOL


GEMV_CASES = [
    # m, n, k, block: one K step, several steps with a partial last one, block scales with partial blocks
    (1, 24, 512, None),
    (1, 24, 3000, None),  # 16-bit rows: three 1,024-wide steps (default_tiling)
    (3, 20, 4100, None),
    (4, 40, 300, None),
    (2, 40, 1024, (32, 128)),
    (1, 50, 4352, (16, 256)),
    (1, 50, 4352, None),  # with 4,096-wide steps, NaN in float32 on the H200 (kernels/fp8_gemv.py default_tiling)
]


@pytest.mark.parametrize("m,n,k,block", GEMV_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_equals_emulation(m, n, k, block, bias):
    """The GEMV quantizes each row itself, to the scales and e4m3 values of model/fp8.py."""
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE) * 5
    x[-1, : k // 3] = 0  # all-zero groups: the smallest scale
    x[0, 7] = 300.0  # one outlier sets its row's (or group's) scale
    _, w_q, w_s = weights(n, k, block, gen)
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    assert fp8_gemv.supports(m, k, block)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    ref = fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config(block=block), b)
    fp8_gemv.fp8_gemv(x, w_q, w_s, block, b, out)  # float32 rows: their own default tiling
    assert out.isfinite().all()
    assert rel(out, ref) < FMA_TOL
    # bf16 rows, the engine's, on the 16-bit default tiling: within bf16 output rounding (2^-8 relative per element)
    x16 = x.to(torch.bfloat16)
    out16 = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    fp8_gemv.fp8_gemv(x16, w_q, w_s, block, b, out16)
    ref16 = fp8.emulated_linear(x16.float(), w_q, w_s, fp8.Fp8Config(block=block), b)
    assert out16.isfinite().all() and rel(out16.float(), ref16) < 8e-3, rel(out16.float(), ref16)
    if block is None:  # the float16-sums candidate: float16's rounding, under bf16's output rounding (2^-9)
        out.fill_(float("nan"))
        fp8_gemv.fp8_gemv(x, w_q, w_s, block, b, out, f16_sums=True)
        assert out.isfinite().all() and rel(out, ref) < 2e-3, rel(out, ref)


def test_fp8_linear_writes_into_out():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=gen).to(DEVICE)
    _, w_q, w_s = weights(64, 256, (32, 128), gen)
    out = torch.empty(4, 64, device=DEVICE)
    got = fp8_gemm.fp8_linear(x, w_q, w_s, (32, 128), out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel(out, fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config(block=(32, 128)))) < TC_TOL
    assert fp8_gemm.fp8_linear(x[:0], w_q, w_s, (32, 128)).shape == (0, 64)


def test_scaled_mm_call_with_rowwise_scales():
    """The arguments fp8_linear gives torch._scaled_mm for per-channel weights (torch's CPU build runs rowwise
    scaling too, so the layouts are checked here; block scales need CUDA)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=gen).to(DEVICE)
    _, w_q, w_s = weights(256, 512, None, gen)
    x_q, x_s = quantize_rows(x, None)
    out = torch.empty(64, 256, device=DEVICE)
    got = scaled_mm.scaled_mm(x_q, x_s, w_q, w_s, None, None, out)
    assert got.data_ptr() == out.data_ptr()
    assert rel(out, fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config())) < TC_TOL


@pytest.mark.parametrize("m", [5, 7, 8])
def test_block_scaled_cublaslt_call_pads_rows_to_a_multiple_of_4(m, monkeypatch):
    """cuBLASLt's block scaling needs activation scales with a 16-byte aligned stride: fp8_linear pads the rows with
    zeros (scale 1) and keeps the first M rows. Checked with a stand-in for torch._scaled_mm that enforces torch's
    layout rule and computes the product from the dequantized operands (block scaling needs CUDA)."""
    block = (128, 128)

    def fake_scaled_mm(x_q, x_s, w_q, w_s, block_, bias, out):
        rows = x_q.shape[0]
        assert rows % 4 == 0 and x_s.shape == (rows, 2) and x_s.stride() == (1, rows) and out.shape[0] == rows
        assert bias is None and torch.equal(x_q[m:].float(), torch.zeros_like(x_q[m:].float()))
        x = fp8.dequantize_activations(x_q, x_s, block_[1])
        return out.copy_(x @ fp8.dequantize(w_q, w_s, block_).t())

    monkeypatch.setattr(fp8_gemm, "uses_scaled_mm", lambda *a: True)
    monkeypatch.setattr(scaled_mm, "scaled_mm", fake_scaled_mm)  # what block_scaled_mm calls
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=gen).to(DEVICE)
    _, w_q, w_s = weights(96, 256, block, gen)
    b = torch.randn(96, generator=gen).to(DEVICE)
    out = torch.full((m, 96), float("nan"), device=DEVICE)
    fp8_gemm.fp8_linear(x, w_q, w_s, block, b, out)
    assert rel(out, fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config(block=block), b)) < FMA_TOL


def test_rowwise_cublaslt_call_adds_the_bias_after(monkeypatch):
    """Per-channel weights with a bias (Qwen2's q/k/v): fp8_linear gives cuBLASLt no bias and adds it after (the
    rowwise call: more rows than the scalar-scaled product takes)."""
    rows = fp8_rescale.MAX_ROWS + 1
    called = []

    def fake_scaled_mm(x_q, x_s, w_q, w_s, block_, bias, out):
        assert bias is None and block_ is None and x_s.shape == (x_q.shape[0], 1)
        called.append(x_q.shape[0])
        return out.copy_(fp8.dequantize_activations(x_q, x_s, None) @ fp8.dequantize(w_q, w_s, None).t())

    monkeypatch.setattr(fp8_gemm, "uses_scaled_mm", lambda *a: True)
    monkeypatch.setattr(fp8_gemm, "scaled_mm", fake_scaled_mm)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 128, generator=gen).to(DEVICE)
    _, w_q, w_s = weights(48, 128, None, gen)
    b = torch.randn(48, generator=gen).to(DEVICE)
    out = fp8_gemm.fp8_linear(x, w_q, w_s, None, b)
    assert called == [rows] and rel(out, fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config(), b)) < FMA_TOL


# cuBLASLt's rowwise FP8 writes bfloat16 only: on a GPU the products below take bf16 rows and outputs
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
OUT_TOL = 1e-2 if ON_GPU else TC_TOL


@pytest.mark.parametrize("bias", [False, True])
def test_scalar_scaled_product_then_rescale_equals_emulation(bias):
    """kernels/fp8_rescale.py: the product with scalar scales, then the token's and channel's scales (and the bias)
    applied by the rescale kernel (torch's CPU build runs scalar scaling; the kernel in the interpreter)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, 512, generator=gen).to(DEVICE, DTYPE)  # a partial program of rows
    _, w_q, w_s = weights(2112, 512, None, gen)  # a partial program of columns; cuBLASLt: N % 16 == 0
    b = torch.randn(2112, generator=gen).to(DEVICE, DTYPE) if bias else None
    x_q, x_s = quantize_rows(x, None)
    out = torch.full((7, 2112), float("nan"), device=DEVICE, dtype=DTYPE)
    got = fp8_rescale.scalar_scaled_linear(x_q, x_s, w_q, w_s, b, out)
    assert got.data_ptr() == out.data_ptr()
    assert rel(out, fp8.emulated_linear(x.float(), w_q, w_s, fp8.Fp8Config(), b)) < OUT_TOL


def test_fp8_linear_takes_scalar_scales_up_to_max_rows(monkeypatch):
    """Per-channel products of 2..MAX_ROWS rows take the scalar-scaled product and the rescale, more rows the
    rowwise one; each equals the emulation."""
    monkeypatch.setattr(fp8_gemm, "uses_scaled_mm", lambda *a: True)
    taken = []
    scalar, rowwise = fp8_rescale.scalar_scaled_linear, scaled_mm.scaled_mm
    monkeypatch.setattr(fp8_rescale, "scalar_scaled_linear", lambda *a: taken.append("scalar") or scalar(*a))
    monkeypatch.setattr(fp8_gemm, "scaled_mm", lambda *a: taken.append("rowwise") or rowwise(*a))
    gen = torch.Generator().manual_seed(5)
    _, w_q, w_s = weights(64, 128, None, gen)
    for m in (2, fp8_rescale.MAX_ROWS, fp8_rescale.MAX_ROWS + 1):
        x = torch.randn(m, 128, generator=gen).to(DEVICE, DTYPE)
        out = fp8_gemm.fp8_linear(x, w_q, w_s, None)
        assert rel(out, fp8.emulated_linear(x.float(), w_q, w_s, fp8.Fp8Config())) < OUT_TOL
    assert taken == ["scalar", "scalar", "rowwise"]


# ---- CUDA: real shapes --------------------------------------------------------------------------------------

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# bf16 output (rel. rounding 2^-9) plus the order of a float32 sum of up to 12,288 products
GPU_TOL = 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(QWEN3_8B))
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 2, 7, 16, 64, 256, 1000])
def test_fp8_linear_gpu(shape, block, m):
    gen = torch.Generator().manual_seed(m)
    n, k = QWEN3_8B[shape]
    x = torch.randn(m, k, generator=gen).to(DEVICE).bfloat16()
    _, w_q, w_s = weights(n, k, block, gen)
    ref = fp8.emulated_linear(x.float(), w_q, w_s, fp8.Fp8Config(block=block))
    out = fp8_gemm.fp8_linear(x, w_q, w_s, block)
    assert out.dtype == torch.bfloat16 and rel(out, ref) < GPU_TOL, rel(out, ref)
    # our Triton kernels, whichever path fp8_linear took
    x_q, x_s = quantize_rows(x, None if block is None else block[1])
    tri = fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, block, None, torch.empty_like(out))
    assert rel(tri, ref) < GPU_TOL, rel(tri, ref)
    if fp8_gemv.supports(m, k, block):
        for f16_sums in (False, True):
            tri = fp8_gemv.fp8_gemv(x, w_q, w_s, block, None, torch.empty_like(out), f16_sums=f16_sums)
            assert rel(tri, ref) < GPU_TOL, (f16_sums, rel(tri, ref))


@gpu
@needs_cuda
def test_scaled_mm_modes_reported():
    """Which scalings torch._scaled_mm runs on this device and build (the lead records it; both are expected on an
    H200 with torch >= 2.9 built against cuBLAS >= 12.9), each checked against the reference at real shapes."""
    modes = scaled_mm.probe_scaled_mm(DEVICE)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "scaled_mm_modes": sorted(modes)}))
    assert "channel" in modes
    gen = torch.Generator().manual_seed(1)
    for mode, block in (("channel", None), ("block", (128, 128))):
        if mode not in modes:
            continue
        x = torch.randn(256, 4096, generator=gen).to(DEVICE).bfloat16()
        _, w_q, w_s = weights(6144, 4096, block, gen)
        x_q, x_s = quantize_rows(x, None if block is None else 128)
        out = scaled_mm.scaled_mm(x_q, x_s, w_q, w_s, block, None, torch.empty(256, 6144, device=DEVICE).bfloat16())
        assert rel(out, fp8.emulated_linear(x.float(), w_q, w_s, fp8.Fp8Config(block=block))) < GPU_TOL


@gpu
@needs_cuda
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_fp8_linear_in_a_cuda_graph(block, m):
    gen = torch.Generator().manual_seed(2)
    _, w_q, w_s = weights(6144, 4096, block, gen)
    scaled_mm.probe_scaled_mm(DEVICE)  # outside the capture, as model loading does
    x = torch.randn(m, 4096, generator=gen).to(DEVICE).bfloat16()
    out = torch.empty(m, 6144, device=DEVICE, dtype=torch.bfloat16)
    fp8_gemm.fp8_linear(x, w_q, w_s, block, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_gemm.fp8_linear(x, w_q, w_s, block, out=out)
    x.copy_(torch.randn(m, 4096, generator=gen).to(DEVICE).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_gemm.fp8_linear(x, w_q, w_s, block))


def test_fp8_kernels_build_for_sm90_without_a_gpu():
    """Every FP8 kernel variant the engine launches on an H100/H200 builds for sm_90a (a compiler run in a
    subprocess, outside the interpreter this suite sets): catches what the interpreter accepts and the GPU does not."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "tests.support.fp8_sm90_build"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert out.stdout.count("ok ") == 32, out.stdout
