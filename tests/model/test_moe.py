"""Qwen3-MoE against HF transformers on tiny float32 checkpoints written with transformers' own classes: the layer
kinds, teacher-forced logits through the paged cache, greedy tokens end to end (roomy and tight engines, TP=2 over
gloo), and the loader's errors for expert tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kernels.moe_norm_route import norm_route
from model.config import ModelConfig
from model.loader import build_model, load_weights
from model.moe import SparseMoeBlock
from nanoserve import LLM, SamplingParams
from tests.support.builders import make_step, worker_config
from tests.support.oracle import hf_greedy, prompts_with_shared_prefixes
from tests.support.tiny_moe import TinyMoeSpec, router_margins, write_tiny_moe_checkpoint
from worker.model_runner import ModelRunner

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def moe_dense_middle(tmp_path_factory) -> Path:
    """3 layers, the middle one dense (mlp_only_layers=[1]); 8 experts, top-2, renormalized; untied."""
    return write_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe_dense_middle"), TinyMoeSpec(seed=4))


@pytest.fixture(scope="module")
def moe_sparse_step(tmp_path_factory) -> Path:
    """4 layers with experts on every second one (decoder_sparse_step=2); top-3, not renormalized; tied."""
    spec = TinyMoeSpec(
        num_hidden_layers=4,
        mlp_only_layers=[],
        decoder_sparse_step=2,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        tie_word_embeddings=True,
        seed=5,
    )
    return write_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe_sparse_step"), spec)


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("fixture,kinds", [("moe_dense_middle", "EDE"), ("moe_sparse_step", "DEDE")])
def test_layer_kinds_follow_hf(fixture, kinds, request):
    model_dir = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_pretrained(model_dir)
    ours = build_model(cfg, torch.device("cpu"), torch.float32)
    hf = hf_model(model_dir)
    theirs = "".join("E" if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" else "D" for layer in hf.model.layers)
    mine = "".join("E" if isinstance(layer.mlp, SparseMoeBlock) else "D" for layer in ours.model.layers)
    assert mine == theirs == kinds


@pytest.mark.parametrize("fixture", ["moe_dense_middle", "moe_sparse_step"])
def test_teacher_forced_logits_match_hf(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    hf = hf_model(model_dir)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 500, n).tolist() for n in (45, 6)]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    r = ModelRunner(worker_config(model_dir), torch.device("cpu"))
    r.allocate_kv(64)

    def close(ours, ref):
        return float((ours - ref).abs().max() / ref.abs().max())

    # a prefill of both, then seq 0's rest as a chunk from its cached prefix beside seq 1's decodes
    step = [
        dict(slot=0, tokens=prompts[0][:30], start=0, new_blocks=[7, 3, 5]),
        dict(slot=1, tokens=prompts[1][:-2], start=0, new_blocks=[0]),
    ]
    out = r.forward_logits(make_step(step))
    assert close(out[:30], refs[0][:30]) < 1e-4
    assert close(out[30:], refs[1][:-2]) < 1e-4
    out = r.forward_logits(make_step([dict(slot=0, tokens=prompts[0][30:]), dict(slot=1, tokens=[prompts[1][-2]])]))
    assert close(out[:-1], refs[0][30:]) < 1e-4
    assert close(out[-1], refs[1][-2]) < 1e-4
    out = r.forward_logits(make_step([dict(slot=1, tokens=[prompts[1][-1]])]))
    assert close(out[0], refs[1][-1]) < 1e-4


def test_one_launch_front_matches_hf(moe_sparse_step, monkeypatch):
    """Decode steps of 1-4 tokens run each MoE layer's norm, router and routing as kernels/moe_norm_route.py (on
    CUDA; on the CPU only where a test asks, here in Triton's interpreter) and its experts as kernels/moe_decode.py;
    a prefill runs the three launches. The logits stay HF's either way."""
    import model.moe

    calls = []
    monkeypatch.setattr(model.moe, "norm_route", lambda *a: calls.append(a[0].shape[0]) or norm_route(*a))
    hf = hf_model(moe_sparse_step)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 500, n).tolist() for n in (9, 6, 7)]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    r = ModelRunner(worker_config(moe_sparse_step), torch.device("cpu"))
    blocks = [m for m in r.model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.front_on_cpu = True
    r.allocate_kv(64)
    step = [dict(slot=i, tokens=p[:-2], start=0, new_blocks=[i]) for i, p in enumerate(prompts)]
    r.forward_logits(make_step(step))
    assert calls == []  # a prefill of 19 tokens: the three launches
    for back in (2, 1):
        out = r.forward_logits(make_step([dict(slot=i, tokens=[p[-back]]) for i, p in enumerate(prompts)]))
        for i, p in enumerate(prompts):
            ref = refs[i][len(p) - back]
            assert float((out[i] - ref).abs().max() / ref.abs().max()) < 1e-4
    assert calls == [3] * (2 * len(blocks))


def test_greedy_parity_roomy_and_tight(moe_dense_middle):
    prompts = prompts_with_shared_prefixes()
    expected = hf_greedy(moe_dense_middle, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(moe_dense_middle), max_model_len=256, num_kv_blocks=256, block_size=16) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [c.token_ids for c in got] == expected
        assert llm.stats()["preemptions"] == 0
    # 18 blocks of 8 tokens for 12 requests of up to 130 tokens; a 32-token step budget
    tight = dict(max_model_len=160, num_kv_blocks=18, block_size=8, max_num_batched_tokens=32)
    with LLM(str(moe_dense_middle), **tight) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [c.token_ids for c in got] == expected
        stats = llm.stats()
        assert stats["preemptions"] > 0
        assert stats["chunked_prefill_steps"] > 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_tp2_matches_hf(moe_sparse_step):
    """Each rank holds every expert's half of the intermediate dimension; routing is replicated."""
    prompts = prompts_with_shared_prefixes()[:8]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = hf_greedy(moe_sparse_step, prompts, 12)
    with LLM(str(moe_sparse_step), tensor_parallel_size=2, device="cpu", max_model_len=256, num_kv_blocks=96) as llm:
        assert len(llm.engine.workers.procs) == 2
        got = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


# ---- loading -----------------------------------------------------------------------------------------------------


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _load(model_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(model_dir)
    load_weights(build_model(cfg, torch.device("cpu"), torch.float32), model_dir)


def test_missing_expert_tensor_is_named(moe_dense_middle, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    bad = _edited_copy(moe_dense_middle, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensors: {name.replace('.', '[.]')}$"):
        _load(bad)


def test_expert_tensor_of_wrong_shape_is_named(moe_dense_middle, tmp_path):
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    bad = _edited_copy(moe_dense_middle, tmp_path / "m", lambda t: t.update({name: t[name][:, :16].clone()}))
    with pytest.raises(ValueError, match=f"tensor '{name}': shape mismatch"):
        _load(bad)


def test_expert_beyond_num_experts_is_refused(moe_dense_middle, tmp_path):
    extra = "model.layers.0.mlp.experts.8.gate_proj.weight"
    src = "model.layers.0.mlp.experts.0.gate_proj.weight"
    bad = _edited_copy(moe_dense_middle, tmp_path / "m", lambda t: t.update({extra: t[src].clone()}))
    with pytest.raises(ValueError, match="expert 8 is out of range: the config has num_experts=8"):
        _load(bad)


def test_config_fields(moe_dense_middle):
    raw = json.loads((moe_dense_middle / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and cfg.mlp_only_layers == (1,) and cfg.decoder_sparse_step == 1
    # the hub's Qwen3-MoE configs say num_experts where transformers 5 writes num_local_experts
    hub = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert ModelConfig.from_dict(hub) == cfg
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and num_experts=8"):
        ModelConfig.from_dict(raw | {"num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="num_experts=8 but no moe_intermediate_size"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "moe_intermediate_size"})


def test_router_margins_are_the_gaps_of_hfs_own_router_logits(moe_sparse_step):
    # The bf16 GPU test picks its prompts clear of router near-ties by this helper (tests/support/tiny_moe.py).
    hf = AutoModelForCausalLM.from_pretrained(moe_sparse_step, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, 509, 40).tolist()
    with torch.no_grad():
        router_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    assert len(router_logits) == 2  # decoder_sparse_step=2: experts on every second of 4 layers
    top = torch.stack([r.reshape(len(ids), -1) for r in router_logits]).topk(4, dim=-1).values  # top-3 and the next
    expected = (top[..., 2] - top[..., 3]).amin(0)
    margins = router_margins(hf, ids)
    assert margins.shape == (len(ids),) and (margins > 0).all()
    torch.testing.assert_close(margins, expected, rtol=1e-5, atol=1e-6)
