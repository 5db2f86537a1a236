"""kernels/moe_decode.py (the MoE layer for a few tokens as two GEMV kernels, which kernels/fused_moe.py's entry point
takes for DecodeTiles) against the grouped GEMMs of kernels/fused_moe.py (MoeTiles) and the torch path of
model/moe.py.

Without CUDA the kernels run in Triton's interpreter (conftest.py) at tiny shapes, with bf16 converted and multiplied
as on the GPU (tests/support/interpreter_bf16.py); tests/kernels/test_moe_decode_gpu.py runs Qwen3-30B-A3B's layer.

Both paths compute the same float32 products; only the order in which they are summed along H and I differs (a
tl.sum tree here, tl.dot there). So where every sum is exact, the outputs are bitwise equal (the rounding of gate,
up, SiLU, h and each y_j, and the float32 sum over the top_k slots in slot order, are the same operations); on
random inputs float32 outputs differ in the last bits and bf16 outputs only where an accumulator straddles a
rounding boundary (isolated elements, by a rounding step)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.fused_moe import fused_moe, grouped_gemm, moe_tiles
from kernels.moe_decode import MAX_TOKENS, DecodeTiles, decode_tiles, uses_moe_decode
from kernels.moe_routing import align_by_expert, route
from model.moe import experts_torch, route_torch
from tests.support.interpreter_bf16 import bf16_like_the_gpu
from tests.support.oracle import rel_err
from tests.support.processes import ROOT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_inputs(tokens: int, hidden: int, inter: int, experts: int, dtype, seed: int):
    """x, float32 router logits (no ties, which torch.topk may break otherwise than route), w13, w2."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = 2 * torch.randn(tokens, experts, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    x, w13, w2 = (t.to(dtype).to(DEVICE) for t in (x, w13, w2))
    return x, logits.to(DEVICE), w13, w2


def exact_inputs(tokens: int, hidden: int, inter: int, experts: int, dtype, seed: int, device=DEVICE):
    """x and w13 small integers (w13 over 8): every gate/up product and partial sum is exact in float32 and in a
    tensor core, whatever the order (steps of 1/8, |sum| <= 0.75 * hidden); w2 has one +-1/2 per row, so each down
    sum has a single term."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randint(-3, 4, (tokens, hidden), generator=gen, device=device).to(dtype)
    logits = 2 * torch.randn(tokens, experts, generator=gen, device=device)
    w13 = (torch.randint(-2, 3, (experts, 2 * inter, hidden), generator=gen, device=device) / 8).to(dtype)
    cols = torch.randint(0, inter, (experts, hidden, 1), generator=gen, device=device)
    signs = torch.randint(0, 2, (experts, hidden, 1), generator=gen, device=device) - 0.5
    w2 = torch.zeros(experts, hidden, inter, device=device).scatter_(2, cols, signs).to(dtype)
    return x, logits.to(dtype), w13, w2


def grouped(x, logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
    """The layer through the grouped GEMMs, at the tiles moe_tiles picks."""
    tiles = moe_tiles(x.shape[0], top_k, w13.shape[0], x.dtype)
    return fused_moe(x, logits, w13, w2, top_k, renormalize, tiles=tiles)


def gemvs(x, logits, w13, w2, top_k: int, renormalize: bool, tiles=None, out=None) -> torch.Tensor:
    """The layer through the GEMV kernels, at ``tiles`` or those decode_tiles picks."""
    tiles = tiles or decode_tiles(x.shape[1], w2.shape[2], top_k, x.dtype)
    return fused_moe(x, logits, w13, w2, top_k, renormalize, out=out, tiles=tiles)


def fused_in_slot_order(x, logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
    """fused_moe's per-pair outputs y (its routing, grouping and grouped GEMMs, as fused_experts runs them), summed
    in float32 in slot order and rounded once: the sum torch.sum does, in an order that does not vary with the
    device or the column (torch's CPU sum takes another order in the columns past its last full vector)."""
    tokens, hidden = x.shape
    weights, ids = route(logits, top_k, renormalize)
    tiles = moe_tiles(tokens, top_k, w13.shape[0], x.dtype)
    groups = align_by_expert(ids, w13.shape[0], tiles.block_m)
    h = torch.empty(tokens * top_k, w2.shape[2], dtype=x.dtype, device=x.device)
    y = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, h, groups, tiles, top_k, gated=True)
    grouped_gemm(h, w2, y, groups, tiles, 1, gated=False, route_weights=weights.reshape(-1))
    total = torch.zeros(tokens, hidden, device=x.device)
    for j in range(top_k):
        total += y.view(tokens, top_k, hidden)[:, j].float()
    return total.to(x.dtype)


def assert_equal_up_to_summation_order(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: a few units in the last place, relative to the norm. 16-bit: where the float32 accumulators of the
    two orders straddle a rounding boundary, h or a y_j rounds the other way and moves an output element by about
    one rounding step; so at most two steps at the largest magnitude anywhere, and less than half a step in the
    norm (not every element moves)."""
    if out.dtype == torch.float32:
        assert rel_err(out, ref) < 1e-6, rel_err(out, ref)
        return
    eps = torch.finfo(out.dtype).eps
    worst = (out.float() - ref.float()).abs().max().item()
    assert worst <= 2 * eps * ref.float().abs().max().item() and rel_err(out, ref) < eps / 2, (worst, rel_err(out, ref))


# (tokens, hidden, inter, experts, top_k, renormalize, tiles): experts 5, 6, 7, 10, 12 are not powers of two; the
# tiles leave H and I short of a whole tile (masked tails, several H and I steps); top_k 5 and 7 mask slots
CASES = [
    (1, 48, 24, 8, 1, False, None),
    (2, 48, 24, 6, 2, True, None),
    (3, 50, 20, 12, 3, False, DecodeTiles(8, 32, 4, 16, 4, 4)),
    (1, 32, 16, 5, 4, True, DecodeTiles(2, 8, 2, 4, 4, 4)),
    (4, 40, 24, 10, 5, True, DecodeTiles(8, 16, 8, 8, 4, 4)),
    (2, 32, 16, 7, 7, True, None),
    (4, 64, 32, 16, 8, True, None),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,renormalize,tiles", CASES)
def test_matches_fused_moe_and_torch(tokens, hidden, inter, experts, top_k, renormalize, tiles, dtype):
    x, logits, w13, w2 = random_inputs(tokens, hidden, inter, experts, dtype, seed=tokens * 100 + top_k)
    with bf16_like_the_gpu():
        fused = grouped(x, logits, w13, w2, top_k, renormalize)
        buf = torch.full((tokens, hidden + 3), float("nan"), dtype=dtype, device=DEVICE)
        out = gemvs(x, logits, w13, w2, top_k, renormalize, tiles, out=buf[:, :hidden])
    assert out.data_ptr() == buf.data_ptr() and out.shape == (tokens, hidden) and out.dtype == dtype
    assert buf[:, hidden:].isnan().all()  # the row stride is honoured
    assert_equal_up_to_summation_order(out, fused)
    ref = experts_torch(x.float(), w13.float(), w2.float(), *route_torch(logits, top_k, renormalize))
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,renormalize,tiles", [CASES[i] for i in (0, 2, 4, 6)])
def test_bitwise_equal_to_fused_where_sums_are_exact(tokens, hidden, inter, experts, top_k, renormalize, tiles, dtype):
    x, logits, w13, w2 = exact_inputs(tokens, hidden, inter, experts, dtype, seed=tokens + top_k)
    with bf16_like_the_gpu():
        out = gemvs(x, logits, w13, w2, top_k, renormalize, tiles)
        ref = fused_in_slot_order(x, logits, w13, w2, top_k, renormalize)
        fused = grouped(x, logits, w13, w2, top_k, renormalize)
    assert torch.equal(out, ref)
    assert_equal_up_to_summation_order(out, fused)  # fused_moe itself: torch.sum's order


def test_no_tokens():
    x, logits, w13, w2 = random_inputs(0, 32, 16, 4, torch.float32, seed=0)
    assert gemvs(x, logits, w13, w2, 2, True).shape == (0, 32)


@pytest.mark.parametrize("tokens", [1, MAX_TOKENS, MAX_TOKENS + 1])
def test_the_entry_point_picks_the_kernels_by_token_count(tokens):
    # fused_moe without tiles: the GEMVs for a decode batch of a few tokens, the grouped GEMMs beyond (bit for bit)
    x, logits, w13, w2 = random_inputs(tokens, 48, 24, 8, torch.float32, seed=tokens)
    picked = (gemvs if uses_moe_decode(tokens) else grouped)(x, logits, w13, w2, 2, True)
    assert torch.equal(fused_moe(x, logits, w13, w2, 2, True), picked)


def test_applies_to_a_few_tokens_and_tiles():
    assert [uses_moe_decode(t) for t in range(MAX_TOKENS + 2)] == [False] + [True] * MAX_TOKENS + [False]
    # Qwen3-30B-A3B: 4 gate + 4 up rows of 2048 (32 KB) per gate/up program; 4 rows of 8 experts' 768 per down one,
    # in steps of 256
    assert decode_tiles(2048, 768, 8) == DecodeTiles(4, 2048, 4, 256, 4, 4)
    assert decode_tiles(2048, 192, 8) == DecodeTiles(4, 2048, 4, 256, 4, 4)  # one TP=4 rank
    assert decode_tiles(2048, 768, 8, torch.float32) == DecodeTiles(4, 2048, 4, 256, 8, 4)  # 64 KB: 8 warps
    assert decode_tiles(2048, 768, 2) == DecodeTiles(4, 2048, 4, 1024, 4, 4)  # top-2: 2 slots of 1,024 a step


def test_kernels_build_for_sm90_without_a_gpu():
    """Both kernels, as Qwen3-30B-A3B's layer launches them at TP=1 and TP=4, build for sm_90a with the PDL wait in
    place and nothing spilled (a subprocess: this one runs Triton's interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "tests.support.moe_sm90_build"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == 6, out.stdout
    assert all(" 0 B spilled" in line and "pdl_wait=True" in line for line in lines), out.stdout
