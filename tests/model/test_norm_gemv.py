"""NANOSERVE_NORM_GEMV=1: at one decode row the RMSNorm in front of the q/k/v and gate/up projections runs inside
their GEMV (kernels/decode_gemm.py ``normed_decode_linear``), one launch fewer each. Here in Triton's interpreter
on float16 models (the GEMV takes 16-bit layers): the logits equal the engine's with the norms apart, and both
norms of each dense layer took the fused path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import model.linear
from kernels import fused
from kernels.decode_gemm import Tiles, decode_linear, normed_decode_linear
from model.linear import LinearBase
from tests.support.builders import make_step, worker_config
from tests.support.tiny_moe import TinyMoeSpec, write_tiny_moe_checkpoint
from worker.model_runner import ModelRunner

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "rows,k,tiles",
    [
        (1, 512, Tiles(8, 512, 1, 4, 1, True)),
        (3, 384, Tiles(4, 128, 3, 4, 1, True)),
        (2, 1536, Tiles(4, 512, 3, 4, 1, True)),
    ],
)
def test_equals_the_norm_kernel_then_the_gemv(dtype, rows, k, tiles):
    """The fused add + RMSNorm kernel followed by the GEMV (rows of 1,536: the row's sum of squares in two chunks,
    the last one part padding; 3 K splits): bit for bit in the interpreter; on a GPU, where the two kernels sum the
    squares in other orders, within float16's rounding of the outputs."""
    g = torch.Generator().manual_seed(rows * k)
    x, res = (torch.randn(rows, k, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    norm_w = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE)
    w = (torch.randn(64, k, generator=g) * 0.05).to(dtype).to(DEVICE)
    out, res_out = normed_decode_linear(x, res, norm_w, 1e-6, w, tiles)
    h, res_ref = fused.rmsnorm(x, norm_w, 1e-6, res)
    assert torch.equal(res_out, res_ref) and torch.equal(res_ref, (x.float() + res.float()).to(dtype))
    ref = decode_linear(h, w, tiles)
    if ON_GPU:
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-3
    else:
        assert torch.equal(out, ref)


def _runner(model_dir, monkeypatch, fused_norms: bool) -> ModelRunner:
    if fused_norms:
        monkeypatch.setenv("NANOSERVE_NORM_GEMV", "1")
    else:
        monkeypatch.delenv("NANOSERVE_NORM_GEMV", raising=False)
    r = ModelRunner(worker_config(model_dir, dtype="float16"), torch.device("cpu"))
    for m in r.model.modules():
        if isinstance(m, LinearBase):
            m.norm_front_on_cpu = True
    r.allocate_kv(64)
    return r


def _logits(r: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    r.forward_logits(make_step([dict(slot=i, tokens=p[:-2], start=0, new_blocks=[i]) for i, p in enumerate(prompts)]))
    # decode steps of one row each: the GEMV's batch
    return [
        r.forward_logits(make_step([dict(slot=i, tokens=[p[-back]])]))[0]
        for back in (2, 1)
        for i, p in enumerate(prompts)
    ]


def test_moe_model_with_a_dense_layer_matches_the_norms_apart(tmp_path, monkeypatch):
    spec = TinyMoeSpec(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, seed=6)
    model_dir = write_tiny_moe_checkpoint(tmp_path, spec)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 500, n).tolist() for n in (9, 6)]
    apart = _logits(_runner(model_dir, monkeypatch, False), prompts)
    calls = []
    monkeypatch.setattr(
        model.linear, "normed_decode_linear", lambda *a: calls.append(a[4].shape) or normed_decode_linear(*a)
    )
    together = _logits(_runner(model_dir, monkeypatch, True), prompts)
    for a, b in zip(apart, together):
        assert float((a - b).abs().max() / a.abs().max()) < 1e-2
    # per decode step: q/k/v in the layers after the first (whose norm has no residual to add), gate/up in the dense
    # middle layer (the MoE layers have their own one-launch front)
    assert len(calls) == 3 * 4 and sorted(set(calls)) == [(320, 128), (512, 128)]
