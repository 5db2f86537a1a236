"""kernels/skinny_gemm.py against F.linear: on CUDA at Qwen3 shapes, on the CPU under TRITON_INTERPRET=1."""

import importlib
import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    if "kernels.skinny_gemm" in sys.modules:  # imported un-interpreted by an earlier test module
        importlib.reload(sys.modules["kernels.skinny_gemm"])

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.skinny_gemm import skinny_gemm  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
SHAPES = [(6144, 4096), (4096, 12288), (1024, 3072), (100, 200)] if ON_GPU else [(48, 64), (33, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_gemm_matches_linear(dtype, n, k, m):
    g = torch.Generator(device=DEVICE).manual_seed(n + k + m)
    x = torch.randn(m, k, device=DEVICE, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(dtype)
    ref = F.linear(x.float(), w.float())
    got = skinny_gemm(x, w).float()
    assert got.shape == (m, n)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
