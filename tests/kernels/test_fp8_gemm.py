"""kernels/fp8_quant.py and kernels/fp8_gemm.py: the activation quantization kernel computes model/fp8.py's scales
and e4m3 values exactly; the FP8 GEMMs (our Triton kernel, and torch._scaled_mm where the device runs it) equal the
float32 emulation up to the GEMM's rounding. CPU: tiny shapes in the Triton interpreter; CUDA (``gpu``): Qwen3-8B's
layer shapes, CUDA graphs, and the engine's FP8 logits against its bf16 logits on dummy weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kernels import fp8_gemm
from kernels.fp8_quant import quantize_rows
from model import fp8
from tests.support.builders import make_step, worker_config
from tests.support.interpreter_fp8 import fix_interpreter_fp8_rounding
from tests.support.processes import ROOT

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


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
@pytest.mark.parametrize("fused", [False, True])
def test_triton_fp8_gemm_equals_emulation(m, n, k, block, bias, fused):
    """Quantized activations in, or (``fused``) the 16-bit ones, quantized by the GEMM itself."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE) * 5
    x[-1, : k // 3] = 0
    _, w_q, w_s = weights(n, k, block, gen)
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    x_q, x_s = (x, None) if fused else quantize_rows(x, None if block is None else block[1])
    out = torch.full((m, n), float("nan"), device=DEVICE)
    fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, block, b, out)
    ref = fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config(block=block), b)
    assert out.isfinite().all()
    assert rel(out, ref) < 1e-5


def test_fp8_linear_writes_into_out():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=gen).to(DEVICE)
    _, w_q, w_s = weights(64, 256, (32, 128), gen)
    out = torch.empty(4, 64, device=DEVICE)
    got = fp8_gemm.fp8_linear(x, w_q, w_s, (32, 128), out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel(out, fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config(block=(32, 128)))) < 1e-5
    assert fp8_gemm.fp8_linear(x[:0], w_q, w_s, (32, 128)).shape == (0, 64)


def test_scaled_mm_call_with_rowwise_scales():
    """The arguments fp8_linear gives torch._scaled_mm for per-channel weights (torch's CPU build runs rowwise
    scaling too, so the layouts are checked here; block scales need CUDA)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=gen).to(DEVICE)
    _, w_q, w_s = weights(256, 512, None, gen)
    x_q, x_s = quantize_rows(x, None)
    out = torch.empty(64, 256, device=DEVICE)
    got = fp8_gemm._scaled_mm(x_q, x_s, w_q, w_s, None, None, out)
    assert got.data_ptr() == out.data_ptr()
    assert rel(out, fp8.emulated_linear(x, w_q, w_s, fp8.Fp8Config())) < 1e-5


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
    # our Triton kernel, whichever path fp8_linear took
    x_q, x_s = quantize_rows(x, None if block is None else block[1])
    tri = fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, block, None, torch.empty_like(out))
    assert rel(tri, ref) < GPU_TOL, rel(tri, ref)
    if m <= fp8_gemm.SMALL_M:  # and with the activations quantized inside it
        tri = fp8_gemm.fp8_gemm(x, None, w_q, w_s, block, None, torch.empty_like(out))
        assert rel(tri, ref) < GPU_TOL, rel(tri, ref)


@gpu
@needs_cuda
def test_scaled_mm_modes_reported():
    """Which scalings torch._scaled_mm runs on this device and build (the lead records it; both are expected on an
    H200 with torch >= 2.9 built against cuBLAS >= 12.9), each checked against the reference at real shapes."""
    modes = fp8_gemm.probe_scaled_mm(DEVICE)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "scaled_mm_modes": sorted(modes)}))
    assert "channel" in modes
    gen = torch.Generator().manual_seed(1)
    for mode, block in (("channel", None), ("block", (128, 128))):
        if mode not in modes:
            continue
        x = torch.randn(256, 4096, generator=gen).to(DEVICE).bfloat16()
        _, w_q, w_s = weights(6144, 4096, block, gen)
        x_q, x_s = quantize_rows(x, None if block is None else 128)
        out = fp8_gemm._scaled_mm(x_q, x_s, w_q, w_s, block, None, torch.empty(256, 6144, device=DEVICE).bfloat16())
        assert rel(out, fp8.emulated_linear(x.float(), w_q, w_s, fp8.Fp8Config(block=block))) < GPU_TOL


@gpu
@needs_cuda
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_fp8_linear_in_a_cuda_graph(block, m):
    gen = torch.Generator().manual_seed(2)
    _, w_q, w_s = weights(6144, 4096, block, gen)
    fp8_gemm.probe_scaled_mm(DEVICE)  # outside the capture, as model loading does
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


def engine_logits(model_dir, steps: int = 0, **kw) -> tuple[torch.Tensor, list[int]]:
    """Teacher-forced logits of two prompts, then ``steps`` greedy decode steps of the first (its tokens)."""
    from worker.model_runner import ModelRunner

    cfg = worker_config(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        attention_backend="triton",
        max_model_len=2048,
        num_kv_blocks=256,
        **kw,
    )
    r = ModelRunner(cfg, DEVICE)
    r.allocate_kv(256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, n).tolist() for n in (300, 40)]
    seqs = [dict(slot=i, tokens=t, start=0, new_blocks=list(range(32 * i, 32 * i + 32))) for i, t in enumerate(prompts)]
    logits = r.forward_logits(make_step(seqs)).float()
    tokens = [int(logits[len(prompts[0]) - 1].argmax())]
    for s in range(steps):
        step = make_step([dict(slot=0, tokens=[tokens[-1]])], step_id=s + 1)
        tokens.append(int(r.forward_logits(step)[0].argmax()))
    del r
    torch.cuda.empty_cache()
    return logits, tokens


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-8b"])
def test_fp8_engine_logits_near_bf16_on_dummy_weights(shape):
    """FP8 weights, FP8 KV and both against the bf16 engine on the same dummy weights (seed 0): relative logit error
    and the fraction of greedy decode steps whose token agrees (the lead records both; the bounds are loose)."""
    from benchmarks.shapes import write_shape

    model_dir = write_shape(shape)
    ref, ref_tokens = engine_logits(model_dir, steps=32)
    record = {"shape": shape}
    for name, kw in {
        "fp8_weights": dict(quantization="fp8"),
        "fp8_kv": dict(kv_cache_dtype="fp8"),
        "fp8_both": dict(quantization="fp8", kv_cache_dtype="fp8"),
    }.items():
        logits, tokens = engine_logits(model_dir, steps=32, **kw)
        record[name] = {
            "rel_err": round(rel(logits, ref), 5),
            "argmax_agree": round((logits.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
            "greedy_steps_agree": round(float(np.mean([a == b for a, b in zip(tokens, ref_tokens)])), 4),
        }
        assert record[name]["rel_err"] < 0.15, record
    print(json.dumps(record))


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
    assert out.stdout.count("ok ") == 14, out.stdout
