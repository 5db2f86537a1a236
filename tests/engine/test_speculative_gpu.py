"""On CUDA: n-gram and EAGLE-3 speculation through the real engine with CUDA graphs (a step of verify and decode
rows replays the decode graph, one row per token) and the Triton kernels. float32: greedy tokens with speculation
equal HF's and the engine's own without it, eager and with graphs, for a dense and a MoE family, with drafts accepted
(tiny loopy checkpoints, as in tests/engine/test_speculative.py); EAGLE-3's drafts equal a reference's."""

from __future__ import annotations

import dataclasses

import pytest

from model.tiny import write_tiny_checkpoint
from nanoserve import LLM, SamplingParams
from tests.engine.test_speculative import LOOPY_STD, SPEC, _prompts
from tests.model.test_families import FAMILIES
from tests.support.builders import GPU_ENGINE
from tests.support.oracle import hf_greedy
from tests.support.tiny_moe import TinyMoeSpec, write_tiny_moe_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_greedy_with_drafts_equals_hf_on_cuda(tmp_path, family, enforce_eager):
    if family == "qwen3_moe":
        model_dir = write_tiny_moe_checkpoint(tmp_path, TinyMoeSpec(std=LOOPY_STD))
    else:
        model_dir = write_tiny_checkpoint(tmp_path, dataclasses.replace(FAMILIES[family], std=LOOPY_STD))
    prompts = _prompts(500)
    expected = hf_greedy(model_dir, prompts, 40)
    eng = dict(GPU_ENGINE, max_model_len=128, max_num_seqs=16, enforce_eager=enforce_eager)
    with LLM(str(model_dir), **eng, speculative_config=SPEC) as llm:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        got = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert got == expected
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_eagle3_drafts_on_cuda(tmp_path, monkeypatch, capfd, enforce_eager):
    """EAGLE-3 on CUDA, eager and with graphs (the target's three states land in the static buffer the decode
    graphs write on replay; the draft's own forwards replay graphs of worker/eagle_graphs.py, captured at start-up):
    a copy draft on a repeating target is exact and accepted; with every draft kept, the output is the independent
    reference's (HF hidden states, a dense draft layer)."""
    from model.tiny import TinySpec
    from tests.support.eagle3_reference import run_accepting_all
    from tests.support.tiny_eagle3 import DraftSpec, write_tiny_eagle3

    eng = dict(GPU_ENGINE, max_model_len=128, max_num_seqs=16, enforce_eager=enforce_eager)
    target = write_tiny_checkpoint(
        tmp_path / "t", TinySpec(tie_word_embeddings=True, seed=1, std=0.02, num_hidden_layers=4)
    )
    draft = write_tiny_eagle3(tmp_path / "d", target, DraftSpec(copy=True, aux_layer_ids=[0, 2, 3]))
    eagle = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    prompts = _prompts(500)
    expected = hf_greedy(target, prompts, 40)
    with LLM(str(target), **eng, speculative_config=eagle) as llm:
        got = [
            c.token_ids
            for c in llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
            )
        ]
        stats = llm.stats()
    assert got == expected
    assert stats["spec_decode_num_accepted_tokens"] > 0.5 * stats["spec_decode_num_draft_tokens"], stats
    # the worker's start-up line (settings/startup_phases.py) books the draft's graph capture, with graphs only
    assert ("draft graphs" in capfd.readouterr().err) != enforce_eager

    monkeypatch.setenv("NANOSERVE_BENCH_ACCEPT_DRAFTS", "1")
    llama = dataclasses.replace(FAMILIES["llama"], num_hidden_layers=4)
    target = write_tiny_checkpoint(tmp_path / "t2", llama)
    draft = write_tiny_eagle3(tmp_path / "d2", target, DraftSpec(draft_vocab_size=400, std=0.3))
    eagle["model"] = str(draft)
    prompt = _prompts(500)[1]
    with LLM(str(target), **eng, async_scheduling=False, speculative_config=eagle) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == run_accepting_all(target, draft, prompt, 24, 3, (2, 2, 1))


@pytest.mark.parametrize("accept_all", [False, True])
def test_eagle3_draft_graphs_replay_and_draft_as_eager_on_cuda(tmp_path, accept_all):
    """The draft's CUDA graphs (captured by the start-up path, after the target's, in their pool) replay for every
    fill of 2+ drafts and every decode/verify-only catch-up, and fill the same drafts, sample the same tokens and
    keep the same draft states as an eager runner, step by step (tests/worker/test_eagle_graphs.py's steps)."""
    from tests.support.tiny_eagle3 import DraftSpec, write_tiny_eagle3
    from tests.worker.test_eagle_graphs import side_by_side

    target = write_tiny_checkpoint(tmp_path / "t", dataclasses.replace(FAMILIES["llama"], num_hidden_layers=4))
    draft = write_tiny_eagle3(tmp_path / "d", target, DraftSpec(draft_vocab_size=400, std=0.3))
    # float32 through the Triton kernels (TF32 dots; the graphs fix the split count for the longest context)
    assert side_by_side(target, draft, "cuda", accept_all, hidden_tol=1e-3) == {"fill": 8, "catch_up": 5}
