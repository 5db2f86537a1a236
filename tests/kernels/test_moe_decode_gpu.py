"""On CUDA: kernels/moe_decode.py's GEMVs (fused_moe at DecodeTiles) at Qwen3-30B-A3B's layer (bf16, top-8 of 128
experts, hidden 2048; the whole intermediate dim of 768 and one TP=4 rank's 192) for 1-4 tokens, against fused_moe's
grouped GEMMs ("fused") and the torch path, eagerly and replayed from a CUDA graph. What the comparisons allow is
explained in tests/kernels/test_moe_decode.py."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from kernels.moe_decode import MAX_TOKENS
from kernels.pdl import pdl_enter, use_pdl
from model.moe import experts_torch, route_torch
from tests.kernels.test_moe_decode import (
    assert_equal_up_to_summation_order,
    exact_inputs,
    fused_in_slot_order,
    gemvs,
    grouped,
)
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
    out = gemvs(x, logits, w13, w2, TOP_K, True)
    fused = grouped(x, logits, w13, w2, TOP_K, True)
    assert_equal_up_to_summation_order(out, fused)
    ref = experts_torch(x.float(), w13.float(), w2.float(), *route_torch(logits, TOP_K, True))
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, ref) <= 1.25 * rel_err(fused, ref), (rel_err(out, ref), rel_err(fused, ref))
    assert torch.equal(out, gemvs(x, logits, w13, w2, TOP_K, True))  # no atomics: the same bits every call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("tokens", [1, MAX_TOKENS])
def test_bitwise_equal_to_fused_where_sums_are_exact(dtype, tokens):
    """Exact gate/up sums (in the tensor cores too) and single-term down sums: the GEMVs and fused_moe's MMAs agree
    to the bit, so every rounding step and the slot-order top-k sum must too."""
    x, logits, w13, w2 = exact_inputs(tokens, HIDDEN, 768, EXPERTS, dtype, seed=tokens, device="cuda")
    out = gemvs(x, logits, w13, w2, TOP_K, True)
    assert torch.equal(out, fused_in_slot_order(x, logits, w13, w2, TOP_K, True))
    assert_equal_up_to_summation_order(out, grouped(x, logits, w13, w2, TOP_K, True))  # torch.sum's own order


@pytest.mark.parametrize("tokens", TOKENS)
def test_cuda_graph_replay_equals_eager(tokens):
    """Captured once, replayed on new inputs (new routing): equals the eager call bit for bit, so nothing reads back
    to the host or sizes a grid from the routing."""
    w13, w2 = expert_weights(768)
    x, logits = tokens_and_logits(tokens, seed=7, logits_dtype=torch.bfloat16)
    out = torch.empty_like(x)
    gemvs(x, logits, w13, w2, TOP_K, True, out=out)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemvs(x, logits, w13, w2, TOP_K, True, out=out)
    for seed in (8, 9):
        new_x, new_logits = tokens_and_logits(tokens, seed=seed, logits_dtype=torch.bfloat16)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, gemvs(x, logits, w13, w2, TOP_K, True), rtol=0, atol=0)
        assert_equal_up_to_summation_order(out, grouped(x, logits, w13, w2, TOP_K, True))


@triton.jit
def _slow_copy_kernel(src_ptr, dst_ptr, n, wait_ns, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """A PDL kernel that spins ``wait_ns`` before it copies: the kernels behind it start and wait meanwhile."""
    pdl_enter(USE_PDL)
    start = globaltimer()
    while globaltimer() - start < wait_ns:
        pass
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def test_graph_replay_behind_a_slow_kernel_routes_on_the_new_logits():
    """The router's logits come from a PDL kernel that takes 50 us, as in the model (the routing kernel's input is
    written by the kernel in front). The down kernel loads expert ids before its PDL wait; were it scheduled while
    routing still waited, it would multiply the experts of the previous replay. One token at a TP=4 rank's slice:
    gate/up's 384 programs are all resident at once, so nothing but its late signal holds the down kernel back
    (Qwen3-30B-A3B's whole slice takes 1,536 programs, too many to be resident at once, and hid this)."""
    tokens = 1
    if not use_pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs an sm90+ GPU")
    w13, w2 = expert_weights(192)
    x, staged = tokens_and_logits(tokens, seed=21, logits_dtype=torch.bfloat16)
    logits, out = torch.empty_like(staged), torch.empty_like(x)

    def step():
        n = staged.numel()
        _slow_copy_kernel[(1,)](
            staged, logits, n, 50_000, BLOCK=triton.next_power_of_2(n), USE_PDL=True, launch_pdl=True
        )
        gemvs(x, logits, w13, w2, TOP_K, True, out=out)

    step()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (22, 23, 24, 25):
        staged.copy_(tokens_and_logits(tokens, seed=seed, logits_dtype=torch.bfloat16)[1])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, gemvs(x, staged, w13, w2, TOP_K, True), rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [1, MAX_TOKENS, MAX_TOKENS + 1])
def test_the_model_layer_takes_the_decode_path_up_to_max_tokens(tokens):
    from model.moe import FusedMoE

    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, 192, renormalize=True).cuda()
    w13, w2 = expert_weights(192)
    layer.w13_weight.data, layer.w2_weight.data = w13, w2
    x, logits = tokens_and_logits(tokens, seed=11)
    expected = (gemvs if tokens <= MAX_TOKENS else grouped)(x, logits, w13, w2, TOP_K, True)
    assert torch.equal(layer(x, logits), expected)
