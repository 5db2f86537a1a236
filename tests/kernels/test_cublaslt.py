"""cuBLASLt algorithm choice (kernels/cublaslt.py, cublaslt_tune.py, cublaslt_fp8.py): every candidate computes
x @ w.T (and the FP8 scaled product), the tuner only routes captured products, and a captured layer replays with
new inputs like torch's matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cublaslt, cublaslt_tune


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,k", [(16, 3072, 4096), (96, 4096, 6144), (224, 3072, 4096), (256, 12288, 4096)])
def test_every_candidate_and_split_k_variant_computes_the_product(rows, n, k):
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    ref = F.linear(x.float(), w.float())
    algos = cublaslt.heuristic_algos(rows, n, k, torch.bfloat16)
    assert algos, "the heuristic offered no algorithm"
    variants = [
        v for a in algos[:2] for v in cublaslt.split_k_variants(a, cublaslt.problem(rows, n, k, torch.bfloat16))
    ]
    assert any(cublaslt.algo_config(v).get("split_k", 1) > 1 for v in variants)
    for algo in algos + variants:
        out = cublaslt.lt_linear(x, w, algo)
        assert _rel_err(out, ref) < 5e-3, cublaslt.algo_config(algo)
        assert torch.equal(out, cublaslt.lt_linear(x, w, algo)), "not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,k", [(2, 6144, 4096), (16, 4096, 12288), (64, 24576, 4096)])
def test_every_fp8_candidate_computes_the_scaled_product(rows, n, k):
    """kernels/cublaslt_fp8.py: each candidate (and split-K variant) of the per-token x per-channel FP8 product
    equals the dequantized product, as torch._scaled_mm does."""
    from kernels import cublaslt_fp8
    from kernels.fp8_quant import quantize_rows
    from model.fp8 import quantize_per_channel

    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x_q, x_s = quantize_rows(torch.randn(rows, k, device="cuda", generator=g).bfloat16(), None)
    w_q, w_s = quantize_per_channel(torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
    ref = (x_q.float() * x_s) @ (w_q.float() * w_s[:, None]).t()
    algos = cublaslt_fp8.algos(rows, n, k)
    assert algos, "the heuristic offered no algorithm"
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    for algo in algos:
        cublaslt_fp8.scaled_linear(x_q, x_s, w_q, w_s, algo, out)
        assert _rel_err(out, ref) < 5e-3, cublaslt.algo_config(algo)


@pytest.mark.gpu
def test_tuned_products_run_only_inside_a_capture_and_replay_new_inputs():
    from model.linear import LinearBase

    rows, n, k = 96, 4096, 6144
    layer = LinearBase(k, n, bias=False).cuda().bfloat16()
    torch.nn.init.normal_(layer.weight, std=k**-0.5)
    others = [torch.randn_like(layer.weight) * k**-0.5 for _ in range(7)]
    cublaslt_tune._chosen.clear()
    try:
        records = cublaslt_tune.tune({(n, k): [layer.weight, *others]}, [rows], min_gain=-1.0)  # take the fastest
        assert len(records) == 1 and records[0].config is not None
        x = torch.randn(rows, k, device="cuda").bfloat16()
        assert cublaslt_tune.chosen_algo(x, layer.weight) is None  # eager: torch's matmul
        assert cublaslt_tune.chosen_algo(x[:, : k // 2], layer.weight[:, : k // 2]) is None
        into = torch.empty(2 * rows * n, device="cuda", dtype=torch.bfloat16)[rows * n :].view(rows, n)
        with torch.inference_mode():
            layer(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(x)
                layer(x, into)  # as a row-parallel layer writes the all-reduce's buffer
            for seed in range(3):
                x.copy_(torch.randn(rows, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
                graph.replay()
                ref = F.linear(x.float(), layer.weight.float())
                assert _rel_err(out, ref) < 5e-3 and _rel_err(into, ref) < 5e-3
    finally:
        cublaslt_tune._chosen.clear()


def test_summary_totals_each_row_count_over_every_layer():
    # what rank 0 prints after tuning: a kept product counts at torch's time, a changed one at its candidate's
    records = [
        cublaslt_tune.TunedProduct(16, 3072, 4096, 36, 12.0, 11.0, None),
        cublaslt_tune.TunedProduct(16, 4096, 2048, 36, 8.0, 6.0, {"tile": 15}),
        cublaslt_tune.TunedProduct(64, 3072, 4096, 36, 20.0, 10.0, {"tile": 16}),
    ]
    text = cublaslt_tune.summary(records)
    assert text.startswith("2 of 3 products")
    assert "16:0.720->0.648" in text and "64:0.720->0.360" in text


@pytest.mark.parametrize(
    "n,k,layers,timed",
    [(6144, 4096, 36, 6), (24576, 4096, 36, 2), (4096, 12288, 36, 3), (4096, 1024, 28, 28), (64, 64, 1, 1)],
)
def test_products_are_timed_over_more_bytes_than_an_l2_not_every_layer(n, k, layers, timed):
    # Qwen3-8B's qkv, gate/up and down products, Qwen3-0.6B's qkv (all 28 layers: 8 MB each), a one-layer model
    ws = [torch.empty(n, k, dtype=torch.bfloat16, device="meta") for _ in range(layers)]
    chosen = cublaslt_tune.timing_weights(ws)
    assert chosen == ws[:timed]
    assert sum(w.numel() * 2 for w in chosen) >= min(cublaslt_tune.TIMING_BYTES, layers * n * k * 2)
