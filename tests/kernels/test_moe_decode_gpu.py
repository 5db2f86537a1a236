"""On CUDA: kernels/moe_decode.py at Qwen3-30B-A3B's layer (bf16, top-8 of 128 experts, hidden 2048; the whole
intermediate dim of 768 and one TP=4 rank's 192) for 1-4 tokens, against fused_moe and the torch path, eagerly and
replayed from a CUDA graph. What the comparisons allow is explained in tests/kernels/test_moe_decode.py."""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.fused_moe import fused_moe
from kernels.moe_decode import MAX_TOKENS, moe_decode
from model.moe import experts_torch, route_torch
from tests.kernels.test_moe_decode import assert_equal_up_to_summation_order, exact_inputs, fused_in_slot_order
from tests.support.oracle import rel_err

pytestmark = pytest.mark.gpu

EXPERTS, HIDDEN, TOP_K = 128, 2048, 8
INTERS = [768, 192]
TOKENS = list(range(1, MAX_TOKENS + 1))


@functools.cache
def expert_weights(inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(inter)
    w13 = torch.randn(EXPERTS, 2 * inter, HIDDEN, generator=gen, device="cuda") / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, inter, generator=gen, device="cuda") / inter**0.5
    return w13.bfloat16(), w2.bfloat16()


def tokens_and_logits(tokens: int, seed: int, logits_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 hidden states and router logits: float32 ones have no ties (torch.topk may break a tie otherwise than
    route), bf16 ones are what the model's router gives."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16()
    return x, (2 * torch.randn(tokens, EXPERTS, generator=gen, device="cuda")).to(logits_dtype)


@pytest.mark.parametrize("inter", INTERS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_matches_fused_moe_and_is_as_close_to_torch(inter, tokens):
    w13, w2 = expert_weights(inter)
    x, logits = tokens_and_logits(tokens, seed=tokens)
    out = moe_decode(x, logits, w13, w2, TOP_K, True)
    fused = fused_moe(x, logits, w13, w2, TOP_K, True)
    assert_equal_up_to_summation_order(out, fused)
    ref = experts_torch(x.float(), w13.float(), w2.float(), *route_torch(logits, TOP_K, True))
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, ref) <= 1.25 * rel_err(fused, ref), (rel_err(out, ref), rel_err(fused, ref))
    assert torch.equal(out, moe_decode(x, logits, w13, w2, TOP_K, True))  # no atomics: the same bits every call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("tokens", [1, MAX_TOKENS])
def test_bitwise_equal_to_fused_where_sums_are_exact(dtype, tokens):
    """Exact gate/up sums (in the tensor cores too) and single-term down sums: the GEMVs and fused_moe's MMAs agree
    to the bit, so every rounding step and the slot-order top-k sum must too."""
    x, logits, w13, w2 = exact_inputs(tokens, HIDDEN, 768, EXPERTS, dtype, seed=tokens, device="cuda")
    out = moe_decode(x, logits, w13, w2, TOP_K, True)
    assert torch.equal(out, fused_in_slot_order(x, logits, w13, w2, TOP_K, True))
    assert_equal_up_to_summation_order(out, fused_moe(x, logits, w13, w2, TOP_K, True))  # torch.sum's own order


@pytest.mark.parametrize("tokens", TOKENS)
def test_cuda_graph_replay_equals_eager(tokens):
    """Captured once, replayed on new inputs (new routing): equals the eager call bit for bit, so nothing reads back
    to the host or sizes a grid from the routing."""
    w13, w2 = expert_weights(768)
    x, logits = tokens_and_logits(tokens, seed=7, logits_dtype=torch.bfloat16)
    out = torch.empty_like(x)
    moe_decode(x, logits, w13, w2, TOP_K, True, out=out)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_decode(x, logits, w13, w2, TOP_K, True, out=out)
    for seed in (8, 9):
        new_x, new_logits = tokens_and_logits(tokens, seed=seed, logits_dtype=torch.bfloat16)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, moe_decode(x, logits, w13, w2, TOP_K, True), rtol=0, atol=0)
        assert_equal_up_to_summation_order(out, fused_moe(x, logits, w13, w2, TOP_K, True))


@pytest.mark.parametrize("tokens", [1, MAX_TOKENS, MAX_TOKENS + 1])
def test_the_model_layer_takes_the_decode_path_up_to_max_tokens(tokens):
    from model.moe import FusedMoE

    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, 192, renormalize=True).cuda()
    w13, w2 = expert_weights(192)
    layer.w13_weight.data, layer.w2_weight.data = w13, w2
    x, logits = tokens_and_logits(tokens, seed=11)
    expected = (moe_decode if tokens <= MAX_TOKENS else fused_moe)(x, logits, w13, w2, TOP_K, True)
    assert torch.equal(layer(x, logits), expected)
