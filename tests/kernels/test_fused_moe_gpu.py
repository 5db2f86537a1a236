"""On CUDA: the fused MoE kernels at real sizes against the torch path (bf16; 8 to 128 experts, top-1 to top-8,
1 to 8,192 tokens, experts that receive no token), inside CUDA graphs, and Qwen3-MoE through the engine against
HF transformers (bf16 teacher-forced logits; float32 greedy tokens with CUDA graphs; TP=2 where two GPUs are)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels.fused_moe import fused_experts, fused_moe, moe_tiles
from model.moe import experts_torch, route_torch
from nanoserve import LLM, SamplingParams
from tests.support.builders import GPU_ENGINE, make_step, worker_config
from tests.support.oracle import hf_greedy, prompts_with_shared_prefixes, rel_err
from tests.support.processes import ROOT, torchrun_cmd
from tests.support.tiny_moe import WIDE_BF16, TinyMoeSpec, router_margins, write_tiny_moe_checkpoint

pytestmark = pytest.mark.gpu

# (experts, hidden, intermediate): Qwen3-30B-A3B's layer, at TP=1 and one TP=4 rank; smaller ones
SHAPES = [(128, 2048, 768), (128, 2048, 192), (64, 1024, 512), (8, 512, 1408)]
TOKENS = [1, 3, 16, 100, 512, 2048, 8192]


@functools.cache
def expert_weights(experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(experts * inter)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter**0.5
    return w13.bfloat16(), w2.bfloat16()


def tokens_and_logits(tokens: int, hidden: int, experts: int, seed: int, idle: tuple[int, ...] = ()):
    """bf16 hidden states and float32 router logits (no ties); the experts in ``idle`` are never picked."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    logits = 2 * torch.randn(tokens, experts, generator=gen, device="cuda")
    logits[:, list(idle)] = -1e4
    return x, logits


@pytest.mark.parametrize("experts,hidden,inter", SHAPES)
@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
def test_fused_experts_match_torch_bf16(experts, hidden, inter, top_k):
    w13, w2 = expert_weights(experts, hidden, inter)
    idle = (1, experts - 2) if experts - 2 >= top_k else ()  # top-8 of 8 experts leaves none idle
    for tokens in TOKENS:
        x, logits = tokens_and_logits(tokens, hidden, experts, seed=tokens, idle=idle)
        weights, ids = route_torch(logits, top_k, renormalize=top_k > 1)
        assert not torch.isin(ids, torch.tensor(idle, device="cuda")).any()
        ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
        tiles = moe_tiles(tokens, top_k, experts, x.dtype)
        out = fused_experts(x, w13, w2, weights, ids.to(torch.int32), tiles=tiles)  # the torch routing: grouped GEMMs
        err = rel_err(out, ref)
        assert err < 1e-2, (tokens, tiles, err)
        # the whole layer, routed on the GPU from the same logits
        assert rel_err(fused_moe(x, logits, w13, w2, top_k, renormalize=top_k > 1, tiles=tiles), out) < 1e-3


@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_all_tokens_to_one_expert(tokens):
    """The most skewed routing: one group holds every token's first pair, most others stay empty."""
    w13, w2 = expert_weights(64, 1024, 512)
    x, logits = tokens_and_logits(tokens, 1024, 64, seed=3)
    logits[:, 5] += 100.0
    ref = experts_torch(x.float(), w13.float(), w2.float(), *route_torch(logits, 2, renormalize=True))
    tiles = moe_tiles(tokens, 2, 64, x.dtype)  # the grouped GEMMs at every count (one token too)
    assert rel_err(fused_moe(x, logits, w13, w2, 2, renormalize=True, tiles=tiles), ref) < 1e-2


@pytest.mark.parametrize("tokens", [1, 24, 600])
def test_fused_moe_in_a_cuda_graph(tokens):
    """Captured once, replayed on new inputs (new routing): equals the eager call, so nothing in the layer reads
    back to the host or sizes a buffer from the routing."""
    w13, w2 = expert_weights(128, 2048, 192)
    x, logits = tokens_and_logits(tokens, 2048, 128, seed=7)
    logits = logits.bfloat16()  # as the model's router gives them
    out, tiles = torch.empty_like(x), moe_tiles(tokens, 8, 128, x.dtype)  # the grouped GEMMs (one token too)
    fused_moe(x, logits, w13, w2, 8, True, out=out, tiles=tiles)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, logits, w13, w2, 8, True, out=out, tiles=tiles)
    for seed in (8, 9):
        new_x, new_logits = tokens_and_logits(tokens, 2048, 128, seed=seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, fused_moe(x, logits, w13, w2, 8, True, tiles=tiles), rtol=0, atol=0)


@pytest.fixture(scope="module")
def moe_bf16(tmp_path_factory) -> Path:
    return write_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe_bf16"), WIDE_BF16)


@pytest.fixture(scope="module")
def moe_f32(tmp_path_factory) -> Path:
    return write_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe_f32"), TinyMoeSpec(seed=4))


def test_bf16_teacher_forced_logits_close_to_hf(moe_bf16):
    """A prefill step of 631 tokens (64-row blocks), then a decode step of two (16-row blocks)."""
    from worker.model_runner import ModelRunner

    # Prompts whose last tokens route clear of a near-tie: with 64 experts a quarter of all rows have their 8th and
    # 9th router logits within one bf16 step, and one rounding then picks another expert (the decode row of seed
    # 0's 600-token prompt, 0.07 from HF under our split decode and 0.01 under the unsplit one).
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 1000, n).tolist() for n in (600, 33)]
    hf32 = AutoModelForCausalLM.from_pretrained(moe_bf16, dtype=torch.float32).cuda().eval()
    assert min(router_margins(hf32, p)[-1].item() for p in prompts) > 0.02
    del hf32
    cfg = worker_config(
        moe_bf16,
        dtype="bfloat16",
        attention_backend="triton",
        device="cuda",
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )
    runner = ModelRunner(cfg, torch.device("cuda"))
    runner.allocate_kv(128)
    tables = [list(range(40)), [40, 41, 42]]
    prefill = [dict(slot=i, tokens=p[:-1], start=0, new_blocks=t) for i, (p, t) in enumerate(zip(prompts, tables))]
    first = runner.forward_logits(make_step(prefill)).float()
    last = runner.forward_logits(make_step([dict(slot=i, tokens=p[-1:]) for i, p in enumerate(prompts)], 1)).float()
    hf = AutoModelForCausalLM.from_pretrained(moe_bf16, dtype=torch.bfloat16).cuda().eval()
    offset = 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p], device="cuda")).logits[0].float()
        mine = torch.cat([first[offset : offset + len(p) - 1], last[i : i + 1]])
        offset += len(p) - 1
        assert rel_err(mine, ref) < 2e-2
        assert rel_err(mine[-1], ref[-1]) < 2e-2  # the decode row alone
        assert (mine.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_greedy_tokens_match_hf(moe_f32, enforce_eager):
    """Decode steps from CUDA graphs (and prefill steps from the whole-forward prefill graphs) when not eager."""
    prompts = prompts_with_shared_prefixes()
    expected = hf_greedy(moe_f32, prompts, 24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(moe_f32), **GPU_ENGINE, max_model_len=256, enforce_eager=enforce_eager, max_num_seqs=16) as llm:
        got = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_bf16_teacher_forced_logits_under_torchrun(moe_bf16):
    cmd = torchrun_cmd(2, "tests.tensor_parallel.tp_logits", "--model", str(moe_bf16))
    cmd += ["--device", "cuda", "--dtype", "bfloat16"]
    out = subprocess.run(cmd, env=dict(os.environ), cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert '"ok": true' in out.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
