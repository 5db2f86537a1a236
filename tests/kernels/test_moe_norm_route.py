"""kernels/moe_norm_route.py (residual add + RMSNorm + router + routing in one launch) against the three kernels it
replaces: kernels/fused.py ``rmsnorm``, the router as a linear layer, kernels/moe_routing.py ``route``.

Without CUDA the kernel runs in Triton's interpreter (conftest.py), bf16 converted as on the GPU
(tests/support/interpreter_bf16.py); on a GPU the same tests run at Qwen3-30B-A3B's shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import fused
from kernels.moe_norm_route import MAX_TOKENS, norm_route
from kernels.moe_routing import route
from tests.support.interpreter_bf16 import bf16_like_the_gpu

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# (hidden, experts, top_k, renormalize): experts 12 and 100 are not powers of two, nor a multiple of a program's 8
SHAPES = [(2048, 128, 8, True), (4096, 64, 4, False)] if ON_GPU else [(64, 12, 3, True), (40, 100, 8, False)]


def inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    residual = 4 * torch.randn(tokens, hidden, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(hidden, generator=gen)
    router_w = torch.randn(experts, hidden, generator=gen) / hidden**0.5
    return (t.to(dtype).to(DEVICE) for t in (x, residual, norm_w, router_w))


def reference(x, residual, norm_w, router_w, top_k, renormalize):
    """The three launches the kernel replaces, logits from a float32 product rounded to the model dtype."""
    h, res = fused.rmsnorm(x, norm_w, 1e-6, residual)
    logits = F.linear(h.float(), router_w.float()).to(x.dtype)
    weights, ids = route(logits, top_k, renormalize)
    return h, res, weights, ids, logits


@pytest.mark.parametrize("tokens", range(1, MAX_TOKENS + 1))
@pytest.mark.parametrize("hidden,experts,top_k,renormalize", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_norm_router_and_route(tokens, hidden, experts, top_k, renormalize, dtype):
    x, residual, norm_w, router_w = inputs(tokens, hidden, experts, dtype, seed=tokens * 7 + experts)
    with bf16_like_the_gpu():
        h_ref, res_ref, w_ref, ids_ref, logits = reference(x, residual, norm_w, router_w, top_k, renormalize)
        ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        for _ in range(2):  # twice: the ticket is back at zero after a launch
            h, res, weights, ids = norm_route(x, residual, norm_w, 1e-6, router_w, top_k, renormalize, ticket)
            assert torch.equal(res, res_ref) and torch.equal(h, h_ref)  # the same operations as rmsnorm
            assert int(ticket.item()) == 0
            # the logits' sums run in another order than F.linear's: a route may differ only at a near-tie
            top = torch.sort(logits.float(), dim=-1, descending=True).values
            gaps = (top[:, top_k - 1] - top[:, top_k]).abs()
            tied = gaps < (2e-2 if dtype == torch.bfloat16 else 1e-5) * top[:, 0].abs().clamp(min=1)
            agree = (ids == ids_ref).all(dim=-1)
            assert (agree | tied).all(), (ids, ids_ref)
            assert torch.allclose(weights[agree], w_ref[agree], rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_refuses_more_tokens_than_it_unrolls():
    x, residual, norm_w, router_w = inputs(MAX_TOKENS + 1, 64, 12, torch.float32, seed=0)
    with pytest.raises(AssertionError):
        norm_route(x, residual, norm_w, 1e-6, router_w, 2, True, torch.zeros(1, dtype=torch.int32, device=DEVICE))
