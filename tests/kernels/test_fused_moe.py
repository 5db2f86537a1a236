"""The fused MoE Triton kernels (routing, grouping by expert, grouped GEMMs) against the torch path of model/moe.py.

Without CUDA they run in Triton's interpreter (conftest.py), at tiny shapes; tests/test_fused_moe_gpu.py runs the
same checks at real sizes on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernels.fused_moe import MoeTiles, fused_experts, fused_moe, moe_tiles
from kernels.moe_routing import align_by_expert, max_grouped_rows, route
from model.moe import experts_torch, route_torch
from tests.support.oracle import rel_err
from tests.support.processes import ROOT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def moe_inputs(tokens: int, hidden: int, inter: int, experts: int, dtype, seed: int = 0, idle: tuple[int, ...] = ()):
    """x, router logits, w13, w2; the experts in ``idle`` get logits so low that no token picks them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = 2 * torch.randn(tokens, experts, generator=gen)
    logits[:, list(idle)] = -1e4
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return [t.to(dtype).to(DEVICE) for t in (x, logits, w13, w2)]


def check_grouping(ids: torch.Tensor, num_experts: int, block_m: int, one_program_max: int) -> None:
    """Every pair appears once, in a block of its own expert; padding rows hold the pair count."""
    groups = align_by_expert(ids.to(torch.int32), num_experts, block_m, one_program_max)
    flat = ids.reshape(-1).long().cpu()
    num_pairs = flat.numel()
    rows = int(groups.num_rows.item())
    counts = torch.bincount(flat, minlength=num_experts)
    assert rows == int((-(-counts // block_m) * block_m).sum()) <= max_grouped_rows(num_pairs, num_experts, block_m)
    assert rows <= groups.sorted_pairs.numel() and rows // block_m <= groups.block_experts.numel()
    pairs = groups.sorted_pairs[:rows].long().cpu()
    block_expert = groups.block_experts[: rows // block_m].long().cpu().repeat_interleave(block_m)
    real = pairs < num_pairs
    assert sorted(pairs[real].tolist()) == list(range(num_pairs))
    assert (pairs[~real] == num_pairs).all()
    assert torch.equal(flat[pairs[real]], block_expert[real])
    assert (torch.diff(block_expert) >= 0).all()  # groups in expert order, as the offsets say


# (100, 8, 16): 800 pairs, more than one loop step of the one-program kernel
@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 1, 8), (5, 2, 8), (37, 3, 6), (100, 8, 16)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_grouping_one_program_and_chunked(tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(tokens * 100 + top_k)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    ids[ids == 1] = 0  # expert 1 receives no token
    check_grouping(ids, num_experts, block_m, one_program_max=4096)
    check_grouping(ids, num_experts, block_m, one_program_max=16)  # chunks of 16 pairs: count, offsets, scatter


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (6, 3), (16, 1)])
def test_route_matches_torch(renormalize, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_experts + top_k)
    logits = torch.randn(37, num_experts, generator=gen).to(DEVICE)
    weights, ids = route(logits, top_k, renormalize)
    ref_w, ref_ids = route_torch(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


def check_fused_moe(tokens, hidden, inter, experts, top_k, renormalize, dtype, tol, tiles=None, idle=()):
    x, logits, w13, w2 = moe_inputs(tokens, hidden, inter, experts, dtype, seed=tokens + experts, idle=idle)
    ref = experts_torch(x.float(), w13.float(), w2.float(), *route_torch(logits.float(), top_k, renormalize))
    weights, ids = route(logits, top_k, renormalize)
    assert not torch.isin(ids, torch.tensor(idle, dtype=ids.dtype, device=ids.device)).any()
    out = fused_experts(x, w13, w2, weights, ids, tiles=tiles)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err:.2e}"
    # the whole layer (routing inside) into a given buffer gives the same
    into = torch.full_like(out, float("nan"))
    fused_moe(x, logits, w13, w2, top_k, renormalize, out=into, tiles=tiles)
    torch.testing.assert_close(into, out, rtol=0, atol=0)


# hidden K = 48 is a multiple of 16 but not of 32 (both K-loop variants on the gate/up GEMM; the down GEMM's
# K = 24 is neither), N = 24 is not a multiple of the 16-wide N tile; experts 2 and 5 idle
TILES = [MoeTiles(16, 16, 32, 2, 4, 2), MoeTiles(32, 16, 16, 4, 4, 2)]


@pytest.mark.parametrize("tiles", TILES, ids=["m16k32", "m32k16"])
@pytest.mark.parametrize("tokens,top_k,renormalize", [(1, 1, False), (3, 2, True), (21, 2, False), (40, 3, True)])
def test_fused_moe_float32(tokens, top_k, renormalize, tiles):
    check_fused_moe(tokens, 48, 24, 8, top_k, renormalize, torch.float32, 1e-5, tiles, idle=(2, 5))


def test_fused_moe_float16_default_tiles():
    tiles = moe_tiles(30, 2, 8, torch.float16)
    assert tiles.block_m == 16
    check_fused_moe(30, 64, 32, 8, 2, True, torch.float16, 5e-3, idle=(7,))


def test_fused_moe_no_tokens():
    x, logits, w13, w2 = moe_inputs(0, 32, 16, 4, torch.float32)
    assert fused_moe(x, logits, w13, w2, 2, True).shape == (0, 32)


def test_tiles_follow_pairs_per_expert():
    # decode batches of 1, 128 and 256 sequences at top-8 of 128 experts: 1/16, 8 and 16 pairs per expert
    assert [moe_tiles(t, 8, 128, torch.bfloat16).block_m for t in (1, 128, 256, 8192)] == [16, 16, 32, 64]


# ---- compiled for an H200 (sm_90) without one ----------------------------------------------------------------------


def test_kernels_compile_for_h200():
    """Triton's compiler and ptxas need no device: every routing kernel and the GEMM at each tile choice compile
    for sm_90, the GEMMs within its shared memory, their weight tiles streamed through cp.async stages, 64-row
    blocks on wgmma, PDL waits in place (a subprocess: this one runs Triton's interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.compile_moe_sm90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    gemms = [r for r in rows if r["kernel"] == "_moe_gemm_kernel"]
    assert len(gemms) == 6 and len(rows) == 11
    for r in gemms:
        assert r["shared"] <= 227 * 1024, r
        assert r["cp_async"] and r["pdl_wait"], r
        assert r["wgmma"] == (r["block_m"] >= 64), r
    one_program = next(r for r in rows if r["kernel"] == "_group_one_program_kernel")
    assert one_program["atomics"] and one_program["barrier"]
